"""The discounted reverse scan, the one primitive under every advantage and return estimator.

    y[t] = x[t] + a[t] * y[t+1],        y = 0 past the end

This package is the bare recurrence: it knows nothing of RL, masks or process groups, and
imports nothing from rlops but ``_checks`` and ``_threads``. Methods, each in its own module
beside the others: ``"reference"`` (the serial loop, the definition), ``"chunked"``
(vectorised torch, any device, differentiable), ``"compiled"`` (a numba single-pass CPU
kernel, the ``fast`` extra), ``"triton"`` (:mod:`rlops.scan.triton`, a two-level scan on
CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` extra; differentiable,
its backward the adjoint scan forward in time) and ``"auto"``; :data:`SCAN` is the family's
dispatch table (:mod:`rlops.scan.table`, its rows built by :mod:`rlops.scan.dispatch`): auto
picks triton on CUDA tensors when triton imports, compiled on CPU when numba is installed and
no gradient is needed, else chunked.
While ``torch.compile`` traces, :func:`scan` is the operator ``rlops::reverse_scan``
(:mod:`rlops.scan._op`): one graph node at every length, which runs this table at run time.

A decay of exactly 0 is an exact cut for every method: nothing beyond it reaches ``y[t]``,
not even NaN or inf (:func:`rlops.scan.decay.decayed`).

The public entry point, :func:`rlops.discounted_cumsum` (argument checks, any ``dim``,
context parallelism), lives with the estimators in :mod:`rlops.advantages`.
"""

from __future__ import annotations

import torch

from rlops.scan._op import reverse_scan_op
from rlops.scan.decay import is_per_token
from rlops.scan.dispatch import METHODS, case_of
from rlops.scan.table import SCAN

__all__ = ["METHODS", "SCAN", "is_per_token", "scan"]


def scan(
    x: torch.Tensor,
    decay: float | torch.Tensor,
    method: str,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The scan on the canonical layout: ``x`` ``[N, T]`` in the compute dtype; ``decay`` a
    float, ``[N, 1]`` or ``[N, T]`` (already checked). ``method`` as in :data:`SCAN`.

    While ``torch.compile`` traces, the scan is the operator ``rlops::reverse_scan``
    (:mod:`rlops.scan._op`): one node for every length, run by this table at run time (an
    explicit method is checked here, at trace time, as in eager code)."""
    case = case_of(x, decay)
    if torch.compiler.is_compiling():
        if method != "auto":
            SCAN.method(method, case)
        return reverse_scan_op(x, decay, method, chunk_size)
    return SCAN(method, case, x, decay, chunk_size)
