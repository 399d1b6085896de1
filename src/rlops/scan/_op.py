"""The scan as one operator that ``torch.compile`` does not trace into: ``rlops::reverse_scan``,
one graph node whatever the length, run by :data:`rlops.scan.SCAN` eagerly at run time. Its
gradient is the same operator again, the adjoint scan forward in time (docs/design/tracing.md):

    gx[t] = gy[t] + a[t−1]·gx[t−1],    ga[t] = gx[t]·y[t+1]   (0 where a[t] = 0)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops.scan._dispatch import case_of
from rlops.scan._table import SCAN


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
    """:data:`rlops.scan._table.SCAN` on ``x`` ``[N, T]`` and a canonical ``decay`` as the
    ``rlops::reverse_scan`` operator (a float decay becomes ``[N, 1]`` float64)."""
    if not isinstance(decay, torch.Tensor):
        decay = x.new_full((x.shape[0], 1), float(decay), dtype=torch.float64)
    return _reverse_scan(x, decay, method, chunk_size or 0)
