"""The discounted reverse scan, the one primitive under every advantage and return estimator.

    y[t] = x[t] + a[t] * y[t+1],        y = 0 past the end

Methods: ``"reference"`` (the serial loop, the definition), ``"chunked"`` (vectorised torch,
any device, differentiable), ``"compiled"`` (a numba single-pass CPU kernel, the ``fast``
extra) and ``"auto"``: compiled on CPU when numba is installed and no gradient is needed,
else chunked.
"""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_float_tensor,
    check_chunk_size,
    check_method,
    check_same_device,
    check_unit_interval,
    compute_dtype,
)
from rlops.scan import compiled
from rlops.scan.chunked import scan_chunked
from rlops.scan.reference import scan_reference

__all__ = ["METHODS", "discounted_cumsum", "resolve_method", "scan"]

METHODS = ("auto", "reference", "chunked", "compiled")


def resolve_method(method: str, x: torch.Tensor, *tensors: object) -> str:
    """Pick the concrete method for ``"auto"``; check that an explicit one can run."""
    check_method(method, METHODS)
    if method == "compiled":
        compiled.require(x)
    if method != "auto":
        return method
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *tensors)
    )
    if x.device.type == "cpu" and compiled.available() and not needs_grad:
        return "compiled"
    return "chunked"


def scan(
    x: torch.Tensor,
    decay: float | torch.Tensor,
    method: str,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The scan on the canonical layout: ``x`` ``[N, T]`` in the compute dtype; ``decay`` a
    float, ``[N, 1]`` or ``[N, T]`` (already checked). ``method`` is a resolved one."""
    if method == "reference":
        return scan_reference(x, decay)
    if method == "compiled":
        return compiled.scan_compiled(x, decay)
    return scan_chunked(x, decay, chunk_size)


def discounted_cumsum(
    x: torch.Tensor,
    discount: float | torch.Tensor,
    *,
    dim: int = -1,
    method: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Discounted reverse cumulative sum along ``dim``: ``y[t] = x[t] + discount[t] * y[t+1]``.

    Equivalently ``y[t] = sum_{k >= t} (prod_{t <= j < k} discount[j]) * x[k]``, with ``y = 0``
    past the end. The primitive under GAE (``x = delta``, ``discount = gamma * lam``),
    discounted returns (``x = r``, ``discount = gamma``), episode ends (``discount = 0`` at the
    last token of a segment) and per-row or per-token discounts.

    Args:
        x: floating tensor, e.g. ``[B, T]`` with time along ``dim``. float16/bfloat16 are
            accumulated in float32 and returned in their own dtype; float64 stays float64.
        discount: a float in [0, 1], or a tensor broadcastable to ``x`` with values in [0, 1]:
            one per row (e.g. ``[B, 1]``) or one per token (``[B, T]``). ``discount[t]`` links
            step t to step t+1. Exactly 0 and exactly 1 are exact.
        dim: the time dimension.
        method: ``"auto"`` (default), ``"reference"``, ``"chunked"`` or ``"compiled"``.
        chunk_size: time steps per chunk for ``"chunked"`` (default 64 for a per-row discount,
            16 for a per-token one; values below 2 act as 2).

    Returns:
        ``y``, same shape, dtype and device as ``x``. Differentiable through ``"chunked"`` and
        ``"reference"`` (``"auto"`` picks ``"chunked"`` when a gradient is needed).

    Example:
        >>> import torch, rlops
        >>> rlops.discounted_cumsum(torch.tensor([[1.0, 1.0, 1.0]]), 0.5)
        tensor([[1.7500, 1.5000, 1.0000]])
    """
    x = as_float_tensor("x", x)
    check_chunk_size(chunk_size)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (time), got a 0-d tensor")
    dim = _check_dim(dim, x.dim())
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
    check_unit_interval("discount", discount)
    method = resolve_method(method, x, discount)

    dtype = compute_dtype(x.dtype)
    xt = x.movedim(dim, -1)
    lead = xt.shape[:-1]
    x2 = xt.reshape(math.prod(lead), xt.shape[-1]).to(dtype)
    decay = _canonical_decay(discount, x, dim, dtype)
    y = scan(x2, decay, method, chunk_size)
    return y.reshape(xt.shape).movedim(-1, dim).to(x.dtype)


def _check_dim(dim: int, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim - 1}] for x of {ndim} dims, got {dim}")
    return dim % ndim


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
