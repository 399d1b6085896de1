"""On-policy distillation from hidden states and the output layer: each chunk of rows' logits
``hidden @ weightᵀ + bias`` is made, used and dropped, and made again in the backward."""

from __future__ import annotations

import torch

from rlops._checks import compute_dtype
from rlops._types import Group
from rlops.distillation import _engine
from rlops.distillation._checks import (
    check_head,
    fail_together,
)
from rlops.distillation.loss import finish, prepare, run_backward, run_forward

__all__ = ["linear_distillation_loss"]

_OP = "linear_distillation_loss"


class _Matmul(_engine.Producer):
    """Rows of ``hidden @ weightᵀ (+ bias)`` in the compute dtype; gradients accumulated. The
    loops are done with a chunk before they ask for the next: every chunk's logits are made in
    the same buffers (no fresh pages to fault in per chunk)."""

    def __init__(
        self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        self.h, self.w, self.b, self.dtype = h, w, b, dtype
        self.rows, self.v_local = h.shape[0], w.shape[0]
        self.grads: list[torch.Tensor | None] = [None, None, None]
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def _buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.shape[0] < rows:
            buf = self.h.new_empty((rows, self.v_local), dtype=dtype)
            self.buffers[dtype] = buf
        return buf[:rows]

    def logits(self, i: int, j: int) -> torch.Tensor:
        h = self.h[i:j]
        if torch.compiler.is_compiling():
            z = (h @ self.w.T).to(self.dtype)
        else:
            z = torch.mm(h, self.w.T, out=self._buffer(h.shape[0], h.dtype))
            z = z if z.dtype == self.dtype else self._buffer(h.shape[0], self.dtype).copy_(z)
        return z if self.b is None else z.add_(self.b)

    def add_grad(self, i: int, j: int, dz: torch.Tensor) -> None:
        gh, gw, gb = self.grads
        if gh is not None and dz.dtype == self.w.dtype and not torch.compiler.is_compiling():
            torch.mm(dz, self.w, out=gh[i:j])
        elif gh is not None:
            gh[i:j] = dz.to(self.w.dtype) @ self.w
        hc = self.h[i:j].to(self.dtype)
        if gw is not None:  # ``weightᵀ``'s gradient: the faster layout for the BLAS
            gw.addmm_(hc.T, dz)
        if gb is not None:
            gb += dz.sum(0)


class _LinearDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, a, ids, spec):
        prod = _Matmul(h, w, b, a.dtype)
        loss, metrics, saved = run_forward(prod, a, ids, spec)
        ctx.spec = spec
        ctx.save_for_backward(h, w, b, a, ids, *saved)
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    def backward(ctx, gloss, *_):
        h, w, b, a, ids, *saved = ctx.saved_tensors
        prod = _Matmul(h, w, b, a.dtype)
        need = ctx.needs_input_grad
        dt = a.dtype
        prod.grads = [
            torch.empty_like(h) if need[0] else None,
            w.new_zeros(w.shape[::-1], dtype=dt) if need[1] else None,
            w.new_zeros(w.shape[:1], dtype=dt) if b is not None and need[2] else None,
        ]
        run_backward(prod, a, ids, tuple(saved), gloss.to(dt), ctx.spec)
        gh, gw, gb = prod.grads
        gw = None if gw is None else gw.T.to(w.dtype).contiguous()
        gb = None if gb is None else gb.to(b.dtype)
        return gh, gw, gb, None, None, None


def linear_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    kind: str = "forward_kl",
    tail: bool = False,
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`rlops.distillation_loss` of ``logits = hidden @ weightᵀ + bias``, never ``[N, V]``.

    Rows are taken in chunks; each chunk's logits are made, reduced and dropped, and made again
    in the backward (a custom autograd function), which accumulates the gradients of
    ``hidden``, ``weight`` and ``bias``. Over ``group`` the weight and bias are vocabulary
    shards (contiguous) and, as :func:`rlops.linear_logprobs_and_entropy`, each rank gets its
    shard's weight gradient and its shard's *partial* hidden gradient, to be summed by the
    layer's input op (:func:`rlops.copy_to_tensor_parallel_region`).

    Args:
        hidden: ``[..., H]`` float hidden states.
        weight: ``[V_local, H]`` the output layer's weight (its shard), hidden's dtype.
        teacher_logprobs, teacher_ids: as :func:`rlops.distillation_loss`, over ``hidden``'s
            leading dimensions.
        bias: ``[V_local]`` the output layer's bias, or None.
        kind, tail, beta, log_prob_min_clamp, temperature, group: as
            :func:`rlops.distillation_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`rlops.distillation_loss`, ``loss`` of shape
        ``hidden.shape[:-1]``.

    Example:
        >>> import torch
        >>> hidden = torch.tensor([[1.0, 0.0]])
        >>> weight = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
        >>> teacher_logprobs, teacher_ids = torch.tensor([[-0.5]]), torch.tensor([[1]])
        >>> loss, _ = linear_distillation_loss(hidden, weight, teacher_logprobs, teacher_ids)
        >>> round(float(loss), 4)
        0.5505
    """
    try:
        h, w, bias = check_head(hidden, weight, bias)
    except (TypeError, ValueError) as e:
        fail_together(_OP, group, e, hidden)
    options = (kind, tail, beta, log_prob_min_clamp, temperature)
    dtype = compute_dtype(h.dtype)
    a, ids, spec = prepare(_OP, group, h, dtype, teacher_logprobs, teacher_ids, options, w.shape[0])
    loss, *metrics = _LinearDistill.apply(h.reshape(-1, h.shape[-1]), w, bias, a, ids, spec)
    return finish(tuple(h.shape[:-1]), loss, metrics, ids is not None)
