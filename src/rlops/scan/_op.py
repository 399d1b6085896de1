"""The scan as one operator that ``torch.compile`` does not trace into: ``rlops::reverse_scan``.

Traced, the chunked scan puts its padding, chunk count and recursion depth into the graph, so
a graph compiled under ``dynamic=True`` would hold for one length only. Registered as a custom
operator (``torch.library.custom_op``) the scan is one node whose output has its input's shape
(the fake implementation), whatever the length: one graph serves every ``[N, T]``.

At run time the operator is an ordinary eager call of :data:`rlops.scan.table.SCAN`, outside any
trace and without autograd, so ``method="auto"`` picks what it picks in eager code for a call
that needs no gradient: the numba kernel on CPU where numba is installed, Triton on CUDA, else
the chunked scan. Its gradient is registered beside it and is the same operator again, the
adjoint of the reverse scan, which is a scan forward in time::

    y[t]  = x[t] + a[t]·y[t+1]                      (the forward)
    gx[t] = gy[t] + a[t−1]·gx[t−1],   gx[0] = gy[0]  (the adjoint: a reverse scan of the
                                                      time-reversed gy with decays a[t−1])
    ga[t] = gx[t]·y[t+1]                             (0 where a[t] = 0: an exact cut has no
                                                      gradient, as on every path)

summed over time for a per-row decay. A decay of exactly 0 stays an exact cut in both scans.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops.scan.dispatch import case_of
from rlops.scan.table import SCAN

__all__ = ["reverse_scan_op"]


def _per_token(x: torch.Tensor, decay: torch.Tensor) -> bool:
    return decay.shape[-1] == x.shape[-1] and x.shape[-1] > 1


@torch.library.custom_op("rlops::reverse_scan", mutates_args=())
def _reverse_scan(
    x: torch.Tensor, decay: torch.Tensor, method: str, chunk_size: int
) -> torch.Tensor:
    with torch.no_grad():
        y = SCAN(method, case_of(x, decay), x, decay, chunk_size or None)
    # the fake's layout (contiguous), never an input itself (a zero scan may hand back x)
    return y.clone(memory_format=torch.contiguous_format) if y is x else y.contiguous()


@_reverse_scan.register_fake
def _(x: torch.Tensor, decay: torch.Tensor, method: str, chunk_size: int) -> torch.Tensor:
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output) -> None:
    x, decay, method, chunk_size = inputs
    ctx.method, ctx.chunk_size = method, chunk_size
    ctx.per_token = _per_token(x, decay)
    ctx.save_for_backward(decay, output if ctx.needs_input_grad[1] else None)


def _backward(ctx, gy: torch.Tensor):
    decay, y = ctx.saved_tensors
    # the adjoint: a reverse scan of the time-reversed gradient, each step's decay a[t − 1]
    back = F.pad(decay[..., :-1], (1, 0)).flip(-1) if ctx.per_token else decay
    gx = _reverse_scan(gy.flip(-1), back, ctx.method, ctx.chunk_size).flip(-1)
    g_decay = None
    if ctx.needs_input_grad[1]:
        y_next = F.pad(y[..., 1:], (0, 1))
        g = torch.where(decay == 0, 0, gx * y_next)
        g_decay = (g if ctx.per_token else g.sum(-1, keepdim=True)).to(decay.dtype)
    return gx, g_decay, None, None


_reverse_scan.register_autograd(_backward, setup_context=_setup)


def reverse_scan_op(
    x: torch.Tensor, decay: float | torch.Tensor, method: str, chunk_size: int | None
) -> torch.Tensor:
    """:data:`rlops.scan.table.SCAN` on ``x`` ``[N, T]`` and a canonical ``decay`` as the
    ``rlops::reverse_scan`` operator (a float decay becomes ``[N, 1]`` float64)."""
    if not isinstance(decay, torch.Tensor):
        decay = x.new_full((x.shape[0], 1), float(decay), dtype=torch.float64)
    return _reverse_scan(x, decay, method, chunk_size or 0)
