"""The public discounted reverse scan: checks, any time ``dim``, context parallelism (which is
why it sits with the estimators, on their carry-only scan, and not in :mod:`rlops.scan`).
"""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_dtype,
    as_float_tensor,
    check_chunk_size,
    check_dim,
    check_same_device,
    check_unit_interval,
    compute_dtype,
)
from rlops._types import CPLayout, Group
from rlops.distributed.collectives import fails_together
from rlops.distributed.layout import check_cp_layout
from rlops.scan import SCAN, case_of, scan

__all__ = ["discounted_cumsum"]


@fails_together("RLOPS_CP_CHECK")
def discounted_cumsum(
    x: torch.Tensor,
    discount: float | torch.Tensor,
    *,
    dim: int = -1,
    method: str = "auto",
    chunk_size: int | None = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
) -> torch.Tensor:
    """Discounted reverse cumulative sum along ``dim``: ``y[t] = x[t] + discount[t] * y[t+1]``.

    Equivalently ``y[t] = sum_{k >= t} (prod_{t <= j < k} discount[j]) * x[k]``, ``y = 0`` past the
    end: GAE is ``x = delta``, ``discount = gamma * lam``; a discount of 0 ends a segment.

    Args:
        x: floating tensor, e.g. ``[B, T]`` with time along ``dim``; half precision is accumulated
            in float32.
        discount: a float in [0, 1], or a tensor broadcastable to ``x`` with values in [0, 1]:
            one per row (e.g. ``[B, 1]``) or one per token (``[B, T]``; ``discount[t]`` links
            step t to t+1). Exactly 0 and exactly 1 are exact.
        dim: the time dimension.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` (numba, CPU) or
            ``"triton"`` (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``).
        chunk_size: time steps per chunk for ``"chunked"`` (default 64 for a per-row discount,
            16 for a per-token one).
        cp_group: a context-parallel group: ``x`` (and a per-token ``discount``) are this rank's
            shards along ``dim`` (:func:`rlops.distributed.cp_shard`), and so is ``y``; one
            ``all_gather`` of one carry per chunk.
        cp_layout: ``"zigzag"`` (Megatron's) or ``"contiguous"`` (slime's ``--allgather-cp``).

    Returns:
        ``y``, same shape, dtype and device as ``x``; differentiable through ``"chunked"``,
        ``"reference"`` and ``"triton"`` (whose backward is the adjoint scan).

    Example:
        >>> import torch, rlops
        >>> rlops.discounted_cumsum(torch.tensor([[1.0, 1.0, 1.0]]), 0.5)
        tensor([[1.7500, 1.5000, 1.0000]])
    """
    x = as_float_tensor("x", x)
    check_chunk_size(chunk_size)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (time), got a 0-d tensor")
    dim = check_dim(dim, x.dim())
    check_cp_layout(cp_layout)
    if isinstance(discount, torch.Tensor):
        check_same_device("x", x, discount=discount)
        if discount.is_complex():
            raise TypeError(f"discount must be a real tensor, got {discount.dtype}")
        try:
            shape = torch.broadcast_shapes(discount.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"discount must be broadcastable to x {list(x.shape)} (e.g. [B, 1] per row or "
                f"[B, T] per token), got {list(discount.shape)}"
            )
    discount = check_unit_interval("discount", discount)
    method = SCAN.method(method, case_of(x, discount))

    dtype = compute_dtype(x.dtype)
    rows = x.dim() == 2 and dim == 1  # [B, T] already: no views to make (each a dispatch)
    xt = x if rows else x.movedim(dim, -1)
    x2 = xt if rows else xt.reshape(math.prod(xt.shape[:-1]), xt.shape[-1])
    # the compiled kernels read and write bfloat16 as it is (computed in float32)
    if not (method == "compiled" and x.dtype == torch.bfloat16 and cp_group is None):
        x2 = as_dtype(x2, dtype)
    decay = _canonical_decay(discount, x, dim, dtype)
    if cp_group is not None:
        from rlops.advantages.context_parallel import Layout, cp_scan

        y = cp_scan(x2, decay, Layout(cp_group, cp_layout), method, chunk_size)
    else:
        y = scan(x2, decay, method, chunk_size)
    return as_dtype(y if rows else y.reshape(xt.shape).movedim(-1, dim), x.dtype)


def _canonical_decay(
    discount: float | torch.Tensor, x: torch.Tensor, dim: int, dtype: torch.dtype
) -> float | torch.Tensor:
    """The discount as a float, ``[N, 1]`` (constant along time) or ``[N, T]``."""
    if not isinstance(discount, torch.Tensor):
        return float(discount)
    n = x.numel() // x.shape[dim] if x.shape[dim] else math.prod(x.shape[:dim] + x.shape[dim + 1 :])
    d = discount.reshape((1,) * (x.dim() - discount.dim()) + tuple(discount.shape))
    d = d.to(dtype)
    if d.shape[dim] == 1 or x.shape[dim] == 1:
        shape = list(x.shape)
        shape[dim] = 1
        return d.expand(shape).movedim(dim, -1).reshape(n, 1)
    return d.expand(x.shape).movedim(dim, -1).reshape(n, x.shape[dim])
