"""The discounted reverse scan, the one primitive under every advantage and return estimator.

    y[t] = x[t] + a[t] * y[t+1],        y = 0 past the end

This package is the bare recurrence: it knows nothing of RL, masks or process groups, and
imports nothing from rlops but ``_checks``. Methods, each in its own module beside the others:
``"reference"`` (the serial loop, the definition), ``"chunked"`` (vectorised torch, any device,
differentiable), ``"compiled"`` (a numba single-pass CPU kernel, the ``fast`` extra) and
``"auto"``: compiled on CPU when numba is installed and no gradient is needed, else chunked.

A decay of exactly 0 is an exact cut for every method: nothing beyond it reaches ``y[t]``,
not even NaN or inf (the carry is selected away, never multiplied by 0).

The public entry point, :func:`rlops.discounted_cumsum` (argument checks, any ``dim``,
context parallelism), lives with the estimators in :mod:`rlops.advantages`.
"""

from __future__ import annotations

import torch

from rlops._checks import check_choice
from rlops.scan import compiled
from rlops.scan.chunked import scan_chunked
from rlops.scan.reference import scan_reference

__all__ = ["METHODS", "is_per_token", "resolve_method", "scan"]

METHODS = ("auto", "reference", "chunked", "compiled")


def is_per_token(decay: float | torch.Tensor, t_len: int) -> bool:
    """Whether a canonical ``decay`` (a float, ``[N, 1]`` or ``[N, T]``) varies along time."""
    return isinstance(decay, torch.Tensor) and decay.shape[-1] == t_len and t_len > 1


def resolve_method(method: str, x: torch.Tensor, *tensors: object) -> str:
    """Pick the concrete method for ``"auto"``; check that an explicit one can run."""
    check_choice("method", method, METHODS)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *tensors)
    )
    if method == "compiled":
        compiled.require(x, needs_grad)
    if method != "auto":
        return method
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
