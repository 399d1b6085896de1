"""The distillation ops' argument checks and the vocabulary layout of a group call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

import torch

from rlops._checks import (
    as_float_tensor,
    check_bool,
    check_choice,
    check_finite_positive,
    check_real,
    compute_dtype,
    shape_error,
    values_checked,
)
from rlops._types import Group
from rlops.distillation._buckets import KINDS
from rlops.distillation._engine import Spec
from rlops.distributed import collectives
from rlops.distributed.groups import group_rank_size

# How far a teacher's log-prob or top-k log-mass may exceed 0 by rounding, by its dtype.
_SLACK = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
_SLACK_FULL = 1e-4


@dataclass(frozen=True)
class Options:
    kind: str
    tail: bool
    beta: float
    clamp: float | None
    tau: float


def check_options(
    kind: object, tail: object, beta: object, clamp: object, temperature: object, topk: bool
) -> Options:
    kind = check_choice("kind", kind, KINDS)
    tail = check_bool("tail", tail)
    b = check_real("beta", beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    c = None if clamp is None else check_real("log_prob_min_clamp", clamp)
    if c is not None and not math.isfinite(c):
        raise ValueError(f"log_prob_min_clamp must be finite or None, got {clamp}")
    tau = check_finite_positive("temperature", temperature)
    if tail and not topk:
        raise ValueError(
            "tail=True needs teacher_ids: the tail is the mass outside the teacher's top-k, and a "
            "full teacher (teacher_ids=None) has none"
        )
    return Options(kind, tail, b, c, tau)


def check_teacher(
    lead: tuple[int, ...], v_local: int, device: torch.device, teacher_logprobs: object,
    teacher_ids: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(teacher_logprobs [..., k or V_local], teacher_ids [..., k] or None)``: shapes, dtypes,
    devices, and (where values are read) log-probs ≤ 0, not NaN, top-k mass ≤ 1, ids unique."""
    a = as_float_tensor("teacher_logprobs", teacher_logprobs)
    ids = None
    if teacher_ids is None:
        if tuple(a.shape) != (*lead, v_local):
            raise shape_error("teacher_logprobs", f"{[*lead, v_local]} like logits", a.shape)
    else:
        if not isinstance(teacher_ids, torch.Tensor):
            raise TypeError(f"teacher_ids must be a torch.Tensor, got {type(teacher_ids).__name__}")
        if (
            teacher_ids.is_floating_point()
            or teacher_ids.is_complex()
            or teacher_ids.dtype == torch.bool
        ):
            raise TypeError(
                f"teacher_ids must be an integer tensor of ids, got {teacher_ids.dtype}"
            )
        ids = teacher_ids
        if ids.dim() != len(lead) + 1 or tuple(ids.shape[:-1]) != lead or ids.shape[-1] < 1:
            raise shape_error("teacher_ids", f"{[*lead, 'k']} (k >= 1) like logits", ids.shape)
        if a.shape != ids.shape:
            raise shape_error("teacher_logprobs", f"{list(ids.shape)} like teacher_ids", a.shape)
    for name, t in (("teacher_logprobs", a), ("teacher_ids", ids)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but logits is on {device}")
    if values_checked(a) and a.numel():
        _check_teacher_values(a, ids)
    return a, ids


def _check_teacher_values(a: torch.Tensor, ids: torch.Tensor | None) -> None:
    a, slack = a.detach(), _SLACK.get(a.dtype, _SLACK_FULL)
    if bool(a.isnan().any()):
        raise ValueError("teacher_logprobs must not be NaN")
    if bool((a > slack).any()):
        raise ValueError(f"teacher_logprobs must be log-probabilities (<= 0), got {float(a.max())}")
    if ids is not None:
        mass = a.to(compute_dtype(a.dtype)).logsumexp(-1).max()
        if float(mass) > math.log1p(slack):
            raise ValueError(
                f"teacher_logprobs: the teacher's top-k mass must be <= 1, got {math.exp(mass):.6g}"
            )
        s = ids.sort(-1).values
        if bool((s[..., 1:] == s[..., :-1]).any()):
            raise ValueError("teacher_ids must not repeat an id within a row")


def check_ids_range(ids: torch.Tensor, vocab: int) -> None:
    k = ids.shape[-1]
    if k > vocab:
        raise ValueError(f"teacher_ids: k = {k} exceeds the vocabulary size V = {vocab}")
    if values_checked(ids) and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"teacher_ids must lie in [0, V) = [0, {vocab}), got [{lo}, {hi}]")


def check_head(
    hidden: object, weight: object, bias: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``hidden [..., H]``, ``weight [V_local, H]`` and ``bias [V_local]`` or None: one dtype,
    one device."""
    h = as_float_tensor("hidden", hidden)
    w = as_float_tensor("weight", weight)
    if h.dim() < 2:
        raise shape_error("hidden", "[..., H]", h.shape)
    if w.dim() != 2 or w.shape[1] != h.shape[-1] or w.shape[0] < 1:
        raise shape_error("weight", f"[V_local, {h.shape[-1]}] (V_local >= 1) like hidden", w.shape)
    b = None if bias is None else as_float_tensor("bias", bias)
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise shape_error("bias", f"[{w.shape[0]}] like weight", b.shape)
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and (t.dtype != h.dtype or t.device != h.device):
            raise TypeError(
                f"{name} must have hidden's dtype and device ({h.dtype}, {h.device}), "
                f"got {t.dtype} on {t.device}"
            )
    return h, w, b


def fail_together(op: str, group: Group, error: Exception, like: object) -> NoReturn:
    """Raise ``error``, a rank's own check's; over a checked group, after joining the call's
    exchange, so every other rank raises a ``ValueError`` naming the rejected argument instead
    of waiting. ``like``: the tensor whose device the exchange uses."""
    try:
        world = group_rank_size(group)[1]
    except (TypeError, ValueError):
        raise error from None
    if world > 1 and collectives.check_enabled("RLOPS_TP_CHECK"):
        device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
        payload = torch.zeros(1, dtype=torch.float64, device=device)
        collectives.exchange(payload, group, collectives.Call(op), failed=error)
    raise error


def _checksum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(torch.int64)
    return (flat * torch.arange(1, 2 * flat.numel() + 1, 2, device=flat.device)).sum()


def layout(
    op: str, group: Group, v_local: int, opts: Options, n: int, a: torch.Tensor,
    ids: torch.Tensor | None, hidden: int = 0,
) -> Spec:  # fmt: skip
    """The call's :class:`Spec`: over a group, one checked exchange of the shard sizes (every
    rank's first id and the whole vocabulary, or the same ``ValueError`` on every rank);
    with the check off (``RLOPS_TP_CHECK=0`` or ``RLOPS_GROUP_CHECK=0``), equal shards."""
    rank, world = group_rank_size(group)
    start, vocab = rank * v_local, world * v_local  # unchecked: equal shards
    if world > 1 and collectives.check_enabled("RLOPS_TP_CHECK"):
        fields: dict[str, object] = {
            "tokens": n, "hidden size": hidden, "k": None if ids is None else ids.shape[-1],
            "kind": opts.kind, "tail": opts.tail, "beta": opts.beta,
            "log_prob_min_clamp": opts.clamp, "temperature": opts.tau, "dtype": a.dtype,
        }  # fmt: skip
        if ids is not None:
            fields["teacher_ids (checksum)"] = _checksum(ids)
        payload = torch.tensor([float(v_local)], dtype=torch.float64, device=a.device)
        sizes = [
            int(r[0])
            for r in collectives.exchange(
                payload, group, collectives.Call(op, implied=None, **fields)
            )
        ]
        start, vocab = sum(sizes[:rank]), sum(sizes)
    if ids is not None:
        check_ids_range(ids, vocab)
    return Spec(opts.kind, opts.tail, opts.beta, opts.clamp, opts.tau, start, vocab, group, world)
