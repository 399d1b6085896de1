"""On-policy distillation from logits: the teacher's top-k (with the tail as one bucket) or full
distribution against the student's softmax, chunked, vocabulary-parallel."""

from __future__ import annotations

import math

import torch

from rlops._checks import as_float_tensor, compute_dtype
from rlops._types import Group
from rlops.distillation import _engine
from rlops.distillation._checks import (
    check_options,
    check_teacher,
    fail_together,
    layout,
)

__all__ = ["distillation_loss"]

_OP = "distillation_loss"
METRICS = ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")


class _Rows(_engine.Producer):
    """Row slices of the logits ``[N, V_local]``, copied in the compute dtype."""

    def __init__(self, z: torch.Tensor, dtype: torch.dtype) -> None:
        self.z, self.dtype = z, dtype
        self.rows, self.v_local = z.shape
        self.grad: torch.Tensor | None = None

    def logits(self, i: int, j: int) -> torch.Tensor:
        return self.z[i:j].to(self.dtype, copy=True)

    def add_grad(self, i: int, j: int, dz: torch.Tensor) -> None:
        assert self.grad is not None
        self.grad[i:j] = dz


def run_forward(
    prod: _engine.Producer, a: torch.Tensor, ids: torch.Tensor | None, spec: _engine.Spec
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``(loss [N], the metrics in :data:`METRICS` order, what the backward reads)``."""
    if ids is None:
        loss, metrics, saved = _engine.full_forward(prod, a, spec)
    else:
        loss, metrics, saved = _engine.topk_forward(prod, a, ids, spec)
    return loss, tuple(metrics.get(m, loss.new_zeros(0)) for m in METRICS), saved


def run_backward(
    prod: _engine.Producer, a: torch.Tensor, ids: torch.Tensor | None,
    saved: tuple[torch.Tensor, ...], gloss: torch.Tensor, spec: _engine.Spec,
) -> None:  # fmt: skip
    if ids is None:
        _engine.full_backward(prod, a, saved, gloss, spec)
    else:
        _engine.topk_backward(prod, ids, saved, gloss, spec)


class _Distill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, a, ids, spec):
        prod = _Rows(z, a.dtype)
        loss, metrics, saved = run_forward(prod, a, ids, spec)
        ctx.spec = spec
        ctx.save_for_backward(z, a, ids, *saved)
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    def backward(ctx, gloss, *_):
        z, a, ids, *saved = ctx.saved_tensors
        prod = _Rows(z, a.dtype)
        prod.grad = torch.empty_like(z)
        run_backward(prod, a, ids, tuple(saved), gloss.to(a.dtype), ctx.spec)
        return prod.grad, None, None, None


def distillation_loss(
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    tail: bool = False,
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token divergence between a teacher and the student's ``softmax(logits / τ)``.

    Over the buckets ``S`` (the teacher's top-k ids, plus with ``tail=True`` one bucket holding
    the rest of each distribution's mass; or, with ``teacher_ids=None``, the vocabulary), with
    ``p_t = exp(teacher_logprobs)`` and ``p_s`` the student's probabilities::

        forward_kl = Σ_S p_t (log p_t − log p_s)        reverse_kl = Σ_S p_s (log p_s − log p_t)
        jsd = β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m),      m = β p_t + (1 − β) p_s

    The student's tail is its own sum ``Σ_{j∉K} p_s,j`` and the teacher's
    ``log(1 − Σ_K p_t)`` is taken from the top-k's log-sum-exp (never ``1 − sum``).
    ``log_prob_min_clamp`` clamps both top-k log-probs from below (verl's ``clamp_min``: no
    gradient below it); the tail and the masses use the unclamped values. Rows are processed
    in chunks (never a second ``[N, V]``); over ``group`` the logits are vocabulary shards
    (contiguous, as :func:`rlops.logprobs_and_entropy` takes them) and the forward costs one
    gather (a full teacher with ``jsd`` or the clamp: two, the log-normaliser first), the
    backward none.

    Args:
        logits: ``[..., V_local]`` the student's logits (``[N, V]`` or ``[B, T, V]``), float.
        teacher_logprobs: ``[..., k]`` the teacher's top-k log-probs, or with
            ``teacher_ids=None`` its full ``[..., V_local]`` log-probs (sharded like the logits).
            Detached.
        teacher_ids: ``[..., k]`` int global ids of the teacher's top-k (unique per row), or None.
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        tail: add the tail bucket (top-k teacher only).
        beta: the JSD's mixture weight, in ``[0, 1]``.
        log_prob_min_clamp: verl's ``DistillationLossConfig.log_prob_min_clamp``, or None.
        temperature: the student's sampling temperature ``τ > 0``.
        group: the vocabulary-parallel process group, or None.

    Returns:
        ``(loss, metrics)``: ``loss`` of shape ``logits.shape[:-1]`` (float32 for half logits),
        to aggregate with :func:`rlops.aggregate_loss`; ``metrics`` per token (detached):
        ``student_mass`` and ``teacher_mass`` (the top-k's), and with ``teacher_ids``,
        ``overlap_count`` (teacher ids among the student's top-k; ties count) and
        ``overlap_token_advantage`` (mean of ``−p_t (log p_t − log p_s)`` over them, verl's).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 1.0, 0.0]])
        >>> loss, m = distillation_loss(logits, torch.tensor([[-0.5]]), torch.tensor([[1]]))
        >>> round(float(loss), 4), round(float(m["student_mass"]), 4)
        (0.5505, 0.2447)

    See https://arxiv.org/abs/2306.13649 (on-policy distillation, GKD).
    """
    try:
        z = as_float_tensor("logits", logits)
        if z.dim() < 2 or z.shape[-1] < 1:
            raise ValueError(f"logits must have shape [..., V] with V >= 1, got {list(z.shape)}")
    except (TypeError, ValueError) as e:
        fail_together(_OP, group, e, logits)
    options = (kind, tail, beta, log_prob_min_clamp, temperature)
    a, ids, spec = prepare(
        _OP, group, z, compute_dtype(z.dtype), teacher_logprobs, teacher_ids, options
    )
    loss, *metrics = _Distill.apply(z.reshape(-1, z.shape[-1]), a, ids, spec)
    return finish(tuple(z.shape[:-1]), loss, metrics, ids is not None)


def prepare(
    op: str, group: Group, like: torch.Tensor, dtype: torch.dtype, teacher_logprobs: object,
    teacher_ids: object, options: tuple[object, object, object, object, object],
    v_local: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, _engine.Spec]:  # fmt: skip
    """The teacher's checked ``[N, k or V_local]`` log-probs (``dtype``) and ``[N, k]`` ids,
    and the call's layout, for ``like``'s leading dimensions (``v_local``: its last one)."""
    lead, v = tuple(like.shape[:-1]), like.shape[-1] if v_local is None else v_local
    try:
        opts = check_options(*options, teacher_ids is not None)
        a, ids = check_teacher(lead, v, like.device, teacher_logprobs, teacher_ids)
    except (TypeError, ValueError) as e:
        fail_together(op, group, e, like)
    n = math.prod(lead)
    a2 = a.detach().to(dtype).reshape(n, a.shape[-1])
    ids2 = None if ids is None else ids.reshape(n, ids.shape[-1]).to(torch.int64)
    hidden = 0 if v_local is None else like.shape[-1]
    return a2, ids2, layout(op, group, v, opts, n, a2, ids2, hidden=hidden)


def finish(
    lead: tuple[int, ...], loss: torch.Tensor, metrics: list[torch.Tensor], topk: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` in the input's leading shape."""
    names = METRICS if topk else METRICS[:2]
    return loss.reshape(lead), {n: m.reshape(lead) for n, m in zip(names, metrics, strict=False)}
