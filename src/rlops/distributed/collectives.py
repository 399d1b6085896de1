"""The one collective of the small group reductions, with the group's consistency check in it
(docs/design/group-calls.md).

:func:`gather`: every rank's few numbers (counts, sums, maxima, moments, row summaries) as
float64 in one ``all_gather``, reduced by the caller in rank order. Each call carries a
:class:`Call`, the description of what the rank was asked to do; its digest rides in a
first exchange of :data:`SLOTS` numbers, the same size on every rank, so ranks asked
different things raise the same ``ValueError`` instead of hanging. ``RLOPS_GROUP_CHECK=0``
(or a family's own switch) removes the check. :func:`exchange` is the same first exchange
read on the host; :func:`fails_together` makes a rank whose own checks fail join it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlops._types import Group
from rlops.distributed.groups import group_rank_size

__all__ = [
    "ENV",
    "REJECTED",
    "SLOTS",
    "Call",
    "check_enabled",
    "exchange",
    "fails_together",
    "gather",
]

ENV = "RLOPS_GROUP_CHECK"
#: float64 numbers of the first exchange of a checked call: the digest and a padded payload
SLOTS = 64
_DIGEST = 2
_MASK = (1 << 52) - 1
#: the field of :func:`exchange` that names the argument a rank's own checks rejected
REJECTED = "argument rejected by the rank's own checks"
_DISAGREE = "the ranks of a process group disagree on "


def check_enabled(*aliases: str) -> bool:
    """Whether the consistency check runs: ``RLOPS_GROUP_CHECK`` is not ``0``, nor any of
    ``aliases`` (the switch of one family of calls, e.g. ``"RLOPS_CP_CHECK"``, which turns off
    the check of those calls only).

    Example:
        >>> check_enabled("RLOPS_CP_CHECK") in (True, False)
        True
    """
    return all(os.environ.get(v, "1") != "0" for v in (ENV, *aliases))


def _canonical(value: object) -> str:
    """An exact text for a described value: floats by their hex form (every bit counts). A
    tensor (a checksum computed on the device) is compared in its own slot, not here."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"a tensor in a call's description must be a 0-dim real number, "
                f"got {value.dtype} of shape {list(value.shape)}"
            )
        return f"tensor:{value.dtype}"
    if value is None or isinstance(value, bool | str | torch.dtype):
        return repr(value)
    if isinstance(value, int):
        return f"int:{value}"
    if isinstance(value, float):
        return f"float:{value.hex()}"
    if isinstance(value, tuple | list):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    raise TypeError(f"a call is described by numbers, strings and tuples, got {type(value)}")


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.item())  # on the error path only
    if (
        isinstance(value, tuple | list)
        and value
        and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value)
    ):  # named items: show as a mapping
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value) + "}"
    return repr(value)


class Call:
    """What one rank was asked to do: everything that must agree across the group.

    Args:
        op: the public function (``"policy_loss"``).
        implied: ``field -> fields it determines``, not reported again when ``field`` differs.
        **fields: the arguments that must agree: numbers, strings, None, dtypes, tuples of those,
            or 0-dim tensors on the payload's device (checksums, compared bit for bit).

    Example:
        >>> Call("aggregate_loss", mode="token-mean").describe()
        {'function': "'aggregate_loss'", 'mode': "'token-mean'"}
    """

    def __init__(
        self, op: str, *, implied: Mapping[str, Iterable[str]] | None = None, **fields: object
    ) -> None:
        self.op = op
        self.fields = {"function": op, **fields}
        self.implied = {k: tuple(v) for k, v in (implied or {}).items()}
        if not torch.compiler.is_compiling():  # (a traced length would be fixed by it)
            for v in self.fields.values():
                _canonical(v)  # refuse an undescribable value at once, not on the error path

    def with_fields(self, **fields: object) -> Call:
        """This call with more fields (e.g. which of its collectives is running)."""
        merged = {k: v for k, v in self.fields.items() if k != "function"}
        return Call(self.op, implied=self.implied, **{**merged, **fields})

    def digest(self) -> list[int]:
        """:data:`_DIGEST` integers in ``[0, 2**52)`` (exact in float64) of the description."""
        text = ";".join(f"{k}={_canonical(v)}" for k, v in self.fields.items())
        raw = hashlib.blake2b(text.encode(), digest_size=8 * _DIGEST).digest()
        return [int.from_bytes(raw[8 * i : 8 * i + 8], "little") & _MASK for i in range(_DIGEST)]

    def slots(self, device: torch.device) -> torch.Tensor:
        """The head of the first exchange: the digest, then each tensor field's bits, float64
        (an int64 field is reinterpreted bit for bit, a float64 one is sent as it is)."""
        head = [torch.tensor(self.digest(), dtype=torch.float64, device=device)]
        for v in self.fields.values():
            if isinstance(v, torch.Tensor):
                v = v.detach().to(device).reshape(1)
                same_size = v.dtype in (torch.int64, torch.float64)
                head.append(v.view(torch.float64) if same_size else v.to(torch.float64))
        return torch.cat(head)

    def describe(self) -> dict[str, str]:
        """Readable ``field -> value`` (what the error message shows)."""
        return {k: _shown(v) for k, v in self.fields.items()}


def _all_gather(flat: torch.Tensor, group: Group, world: int) -> torch.Tensor:
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat, group=group)
    return torch.stack(parts)


def _disagreement(descriptions: list[dict[str, str]], implied: Mapping) -> str:
    """The message for gathered descriptions that differ (the same on every rank)."""

    def values(field: str) -> list[str]:
        return [d.get(field, "<absent>") for d in descriptions]

    fields: list[str] = []
    for d in descriptions:
        fields += [f for f in d if f not in fields]
    differ = [f for f in fields if len(set(values(f))) > 1]
    if "function" in differ:
        differ = ["function"]
    elif REJECTED in differ:  # a rank whose own checks failed: that is the news
        differ = [REJECTED]
    hidden = {g for f in differ for g in implied.get(f, ())}
    shown = [f for f in differ if f not in hidden and f != "payload shape"] or differ
    parts = [f"`{f}`: [{', '.join(values(f))}]" for f in shown] or [
        "a value computed on the device (equal as numbers, different bits)"
    ]
    return (
        _DISAGREE + "; ".join(parts) + " (one value per "
        "rank, in rank order; every rank of the group must make the same call)"
    )


def gather(
    payload: torch.Tensor,
    group: Group,
    call: Call,
    name: str = "group",
    *,
    check: bool | None = None,
) -> torch.Tensor:
    """Every rank's ``payload`` over ``group`` after the check that every rank makes the same
    ``call``.

    Args:
        payload: this rank's numbers, any shape; its size must follow from ``call``.
        group: a process group, or None (one process: no collective).
        call: the description of this rank's call.
        name: the argument that holds ``group`` (named in errors).
        check: whether the check runs; None asks :func:`check_enabled`. The same on every rank.

    Returns:
        ``[world, *payload.shape]`` float64, detached: row ``r`` is rank ``r``'s payload.

    Raises:
        ValueError: the same on every rank when the calls differ, naming each differing field
            and every rank's value.
    """
    world = group_rank_size(group, name)[1]
    flat = payload.detach().to(torch.float64).reshape(-1)
    if world == 1:
        return flat.reshape(1, *payload.shape)
    if not (check_enabled() if check is None else check):
        return _all_gather(flat, group, world).reshape(world, *payload.shape)
    _entered(group)
    call = call.with_fields(**{"collective over": name, "payload shape": tuple(payload.shape)})
    head = call.slots(flat.device)
    h = head.numel()
    if h > SLOTS:
        raise ValueError(f"a call's description holds at most {SLOTS - _DIGEST} tensors")
    fits = flat.numel() <= SLOTS - h
    sent = flat if fits else flat[:0]
    first = torch.cat([head, sent, flat.new_zeros(SLOTS - h - sent.numel())])
    rows = _all_gather(first, group, world)
    # the check's host read (RLOPS_GROUP_CHECK=0 skips it); compared bit for bit. The digest
    # comes first, so ranks whose heads have different lengths already differ there.
    heads = rows[:, :h].contiguous().view(torch.int64).tolist()
    if any(x != heads[0] for x in heads):
        descriptions: list = [None] * world
        dist.all_gather_object(descriptions, call.describe(), group=group)
        raise ValueError(_disagreement(descriptions, call.implied))
    if fits:
        return rows[:, h : h + flat.numel()].reshape(world, *payload.shape)
    return _all_gather(flat, group, world).reshape(world, *payload.shape)


def _rejected_argument(error: Exception) -> str:
    """The argument an error of a rank's own checks names: its message's first word (for a
    rank that failed with its peers in another group, says so)."""
    if str(error).startswith(_DISAGREE):  # raised by a collective of this module
        return "(none: failed with its peers in another group)"
    word = re.match(r"[`'\"]?([A-Za-z_][\w.]*)", str(error))
    return word.group(1) if word else type(error).__name__


def exchange(
    payload: torch.Tensor,
    group: Group,
    call: Call,
    name: str = "group",
    *,
    failed: Exception | None = None,
) -> list[list[float]]:
    """Every rank's small ``payload`` over ``group`` on the host, after the check that every rank
    makes the same ``call``: one ``all_gather`` of :data:`SLOTS` numbers, one host read.

    Args:
        payload: this rank's numbers (at most :data:`SLOTS` minus the call's head); may differ
            across ranks (e.g. each shard's size).
        group: a process group, or None (one process: no collective).
        call: the description of this rank's call.
        name: the argument that holds ``group`` (named in errors).
        failed: the error this rank's own checks raised, if any: the rank joins, then raises it;
            the others raise a ``ValueError`` naming its rejected argument.

    Returns:
        ``[world][payload.numel()]`` Python floats, rank order.
    """
    world = group_rank_size(group, name)[1]
    flat = payload.detach().to(torch.float64).reshape(-1)
    own = {k: v for k, v in call.fields.items() if k != "function"} if failed is None else {}
    fields = {
        **own,
        REJECTED: None if failed is None else _rejected_argument(failed),
        "collective over": name,
        "payload shape": tuple(payload.shape),
    }
    implied = {**call.implied, REJECTED: tuple(k for k in own)}  # a rejecting rank has no others
    call = Call(call.op, implied=implied, **fields)
    head = call.slots(flat.device)
    h, n = head.numel(), flat.numel()
    if h + n > SLOTS:
        raise ValueError(f"exchange sends at most {SLOTS} numbers, got {h} + {n}")
    if world == 1:
        rows = [torch.cat([head, flat]).view(torch.int64).tolist()]
    else:
        first = torch.cat([head, flat, flat.new_zeros(SLOTS - h - n)])
        # the check's one host read, bit for bit (a head of another length differs in digest)
        rows = _all_gather(first, group, world)[:, : h + n].contiguous().view(torch.int64).tolist()
        if any(row[:h] != rows[0][:h] for row in rows):
            descriptions: list = [None] * world
            dist.all_gather_object(descriptions, call.describe(), group=group)
            if failed is not None:
                raise failed
            raise ValueError(_disagreement(descriptions, call.implied))
    if failed is not None:
        raise failed
    return [[struct.unpack("<d", struct.pack("<q", b))[0] for b in row[h:]] for row in rows]


# --------------------------------------------------------------------------- failing together
_calls = threading.local()  # ``entered``: ids of the groups the running public call has gathered on
F = TypeVar("F", bound=Callable[..., Any])


def _entered(group: Group) -> None:
    entered = getattr(_calls, "entered", None)
    if entered is not None:
        entered.add(id(group))


def _join_rejecting(
    error: Exception, op: str, group: Group, name: str, device: torch.device
) -> None:
    """Make the first exchange of a checked :func:`gather` over ``group`` as a rank whose own
    checks raised ``error``: its head describes only ``op`` and the rejected argument, so every
    other rank reads different digests, joins the readable exchange and raises."""
    world = group_rank_size(group, name)[1]
    if world == 1:
        return
    fields: dict[str, object] = {REJECTED: _rejected_argument(error), "collective over": name}
    call = Call(op, implied=None, **fields)
    head = call.slots(device)
    _all_gather(torch.cat([head, head.new_zeros(SLOTS - head.numel())]), group, world)
    descriptions: list = [None] * world
    dist.all_gather_object(descriptions, call.describe(), group=group)


def fails_together(*aliases: str) -> Callable[[F], F]:
    """Decorate a public function with ``group=`` / ``cp_group=``: a rank whose own argument
    checks raise before a group's collective still joins its first exchange (``cp_group``, then
    ``group``), rejecting, then raises; the others raise a ``ValueError`` naming the rejected
    argument. Only with the check on (:func:`check_enabled` with ``aliases``); not while
    ``torch.compile`` traces; a nested public call leaves it to the outer one.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if (
                (kwargs.get("cp_group") is None and kwargs.get("group") is None)
                or torch.compiler.is_compiling()
                or getattr(_calls, "entered", None) is not None
            ):
                return fn(*args, **kwargs)
            groups = [(kwargs.get(n), n) for n in ("cp_group", "group")]
            entered: set[int] = set()
            _calls.entered = entered
            try:
                return fn(*args, **kwargs)
            except (ValueError, TypeError) as e:
                if check_enabled(*aliases):
                    device = next(
                        (
                            a.device
                            for a in (*args, *kwargs.values())
                            if isinstance(a, torch.Tensor)
                        ),
                        torch.device("cpu"),
                    )
                    for g, n in groups:
                        if g is not None and id(g) not in entered:
                            try:
                                _join_rejecting(e, fn.__name__, g, n, device)
                            except (ValueError, TypeError):  # not a usable group: it was the error
                                break
                raise
            finally:
                _calls.entered = None

        return call  # type: ignore[return-value]

    return wrap
