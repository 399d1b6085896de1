"""Tensor-parallel consistency check: one fixed-size all-gather before the statistics.

Every rank of a vocabulary-parallel call sends a header of 15 int64 numbers (:data:`FIELDS`):
the operation, its shard size ``V_local``, the number of tokens, the hidden size (linear op),
the input dtype, the flags, the temperature (its float64 bits), the sampler's scalar top_k,
top_p and min_p (per-token values are not compared), a position-weighted checksum of the
target ids, and the argument that it rejected, if any. Every rank then reads the same
``[world, 15]`` numbers and either

- derives its offset in the vocabulary (the sum of the shard sizes of the ranks before it) and
  the full vocabulary size, so shards of unequal size are merged correctly, or
- raises the same ``ValueError`` naming what disagrees with each rank's value,

instead of returning wrong log-probs or aborting inside the statistics' collective (whose size
depends on the tokens and the flags). A rank whose own arguments fail the local checks still
joins the header exchange: it raises its own error, the others a ``ValueError`` naming it.

Reading the gathered header is a host synchronisation (on accelerators). ``RLOPS_TP_CHECK=0``
in every rank's environment turns the check off: exactly one collective per forward remains,
nothing is read on the host, and the shards must then have equal sizes (rank ``r`` holds ids
``[r·V_local, (r+1)·V_local)``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["FIELDS", "Call", "check_enabled", "fail_together", "sampler_fields", "shard_layout"]

ENV = "RLOPS_TP_CHECK"
FIELDS = (
    "rejected argument",
    "operation",
    "vocabulary shard size",
    "tokens",
    "hidden size",
    "dtype",
    "with_entropy",
    "entropy_grad",
    "keep_mask given",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "entropy_over_support",
    "target ids (position-weighted checksum)",
)
_BAD, _OP, _V_LOCAL, _TOKENS, _HIDDEN, _TARGET = 0, 1, 2, 3, 4, len(FIELDS) - 1
# A difference in the key implies one in the value: only the key is reported.
_IMPLIED = {_TOKENS: _TARGET, _OP: _HIDDEN}
_OPS = ("logprobs_and_entropy", "linear_logprobs_and_entropy")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Arguments a rank may reject locally; an error message starts with the argument's name.
_ARGUMENTS = (
    "logits",
    "target",
    "keep_mask",
    "temperature",
    "with_entropy",
    "entropy_grad",
    "chunk_size",
    "hidden",
    "weight",
    "top_k",
    "top_p",
    "min_p",
    "entropy_over_support",
)
# A sampler parameter given per token (a tensor): its values are not compared.
_PER_TOKEN = -1


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def sampler_fields(top_k: object, top_p: object, min_p: object, over: object) -> tuple:
    """The header's ``(top_k, top_p, min_p, entropy_over_support)`` numbers: 0 when not given,
    ``-1`` when per token, else the int or the float64 bits (after the local checks)."""

    def one(x, integer):
        if x is None:
            return 0
        if isinstance(x, torch.Tensor):
            return _PER_TOKEN
        return int(x) if integer else _bits(float(x))

    return one(top_k, True), one(top_p, False), one(min_p, False), int(bool(over))


def check_enabled() -> bool:
    """Whether the check runs (``RLOPS_TP_CHECK`` is not ``0``)."""
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class Call:
    """What one rank was asked to compute: everything that must agree across the group."""

    op: str
    v_local: int
    tokens: int
    hidden: int
    dtype: torch.dtype
    with_entropy: bool
    entropy_grad: bool
    masked: bool
    temperature: float
    sampler: tuple = (0, 0, 0, 0)

    def header(self) -> list[int]:
        """The :data:`FIELDS` but the target checksum (computed on the device)."""
        bits = _bits(self.temperature)
        return [
            0,
            _OPS.index(self.op) + 1,
            self.v_local,
            self.tokens,
            self.hidden,
            _DTYPES.index(self.dtype) + 1 if self.dtype in _DTYPES else 0,
            int(self.with_entropy),
            int(self.entropy_grad),
            int(self.masked),
            bits,
            *self.sampler,
        ]


def _checksum(target: torch.Tensor) -> torch.Tensor:
    """``Σ_t (t + 1) · target[t]`` in int64 (wrapping): the same on ranks with the same ids."""
    flat = target.reshape(-1)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
    return (flat * weights).sum().reshape(1)


def _fallback_device(group: dist.ProcessGroup) -> torch.device:
    """Where the header lives when a rank's own inputs gave no usable device."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shown(field: int, values: list[int]) -> list:
    if field == _OP:
        return [_OPS[v - 1] if 0 < v <= len(_OPS) else v for v in values]
    if field == FIELDS.index("dtype"):
        return [_DTYPES[v - 1] if 0 < v <= len(_DTYPES) else "other" for v in values]
    if FIELDS[field] in ("with_entropy", "entropy_grad", "keep_mask given"):
        return [bool(v) for v in values]
    if FIELDS[field] in ("temperature", "top_p", "min_p"):
        return [
            "per token" if v == _PER_TOKEN else
            (None if v == 0 and field != FIELDS.index("temperature") else
             struct.unpack("<d", struct.pack("<q", v))[0])
            for v in values
        ]
    if field == FIELDS.index("top_k"):
        return ["per token" if v == _PER_TOKEN else (None if v == 0 else v) for v in values]
    if field == FIELDS.index("entropy_over_support"):
        return [bool(v) for v in values]
    return values


def _gather(header: torch.Tensor, group: dist.ProcessGroup, world: int) -> list[list[int]]:
    out = header.new_empty(world * header.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, header, group=group)
    return out.view(world, -1).tolist()  # the check's host read (RLOPS_TP_CHECK=0 skips it)


def fail_together(
    group: dist.ProcessGroup, world: int, error: Exception, device: torch.device | None
) -> NoReturn:
    """Join the header exchange as a rank whose local checks raised ``error``, then raise it.

    ``device``: where the header goes (the inputs' device), or None if none is known.
    """
    name = str(error).split(" ", 1)[0]
    header = [0] * len(FIELDS)
    header[_BAD] = _ARGUMENTS.index(name) + 1 if name in _ARGUMENTS else len(_ARGUMENTS) + 1
    dev = device if device is not None else _fallback_device(group)
    _gather(torch.tensor(header, dtype=torch.int64, device=dev), group, world)
    raise error


def shard_layout(
    group: dist.ProcessGroup, rank: int, world: int, call: Call, target: torch.Tensor
) -> tuple[int, int]:
    """Exchange the headers; return ``(this shard's first id, full vocabulary size)`` or raise
    the same ``ValueError`` on every rank. ``target``: this rank's ids (the header's device)."""
    head = torch.tensor(call.header(), dtype=torch.int64, device=target.device)
    rows = _gather(torch.cat([head, _checksum(target)]), group, world)
    bad = [r for r, row in enumerate(rows) if row[_BAD]]
    if bad:
        names = [
            _ARGUMENTS[rows[r][_BAD] - 1] if rows[r][_BAD] <= len(_ARGUMENTS) else "an argument"
            for r in bad
        ]
        raise ValueError(
            f"tensor-parallel rank(s) {bad} of the group rejected their argument(s) {names} "
            "(see the error raised there); every rank of group must make the same call"
        )
    differ = {j for j in range(len(FIELDS)) if any(row[j] != rows[0][j] for row in rows)}
    differ -= {_V_LOCAL} | {_IMPLIED[j] for j in differ if j in _IMPLIED}
    wrong = [f"{FIELDS[j]}: {_shown(j, [row[j] for row in rows])}" for j in sorted(differ)]
    if wrong:
        raise ValueError(
            "tensor-parallel ranks disagree on " + "; ".join(wrong) + " (one value per rank; "
            "every rank of group must make the same call on its own vocabulary shard)"
        )
    sizes = [row[_V_LOCAL] for row in rows]
    return sum(sizes[:rank]), sum(sizes)
