"""The discounted reverse scan, the one primitive under every advantage and return estimator.

    y[t] = x[t] + a[t] * y[t+1],        y = 0 past the end

The bare recurrence: nothing of RL, masks or process groups. Methods side by side:
``reference`` (the loop), ``chunked`` (torch, any device, differentiable), ``compiled`` (numba,
CPU) and ``triton`` (CUDA; differentiable); :data:`SCAN` is its dispatch table, and
``_dispatch`` the one dispatch every estimator family builds its table on. A decay of exactly
0 is an exact cut for every method (docs/design/scan.md). The public entry point is
:func:`rlops.discounted_cumsum`.
"""

from __future__ import annotations

import torch

from rlops.scan._dispatch import (
    CHUNKED,
    COMPILED,
    METHODS,
    REFERENCE,
    TRITON_FORWARD,
    Case,
    Row,
    Table,
    case_of,
)
from rlops.scan._op import reverse_scan_op
from rlops.scan._table import SCAN
from rlops.scan.decay import is_per_token

# the dispatch (``_dispatch``) is this package's: the estimator families build their tables on it
__all__ = [
    "CHUNKED",
    "COMPILED",
    "METHODS",
    "REFERENCE",
    "SCAN",
    "TRITON_FORWARD",
    "Case",
    "Row",
    "Table",
    "case_of",
    "is_per_token",
    "scan",
]


def scan(
    x: torch.Tensor,
    decay: float | torch.Tensor,
    method: str,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The scan on the canonical layout: ``x`` ``[N, T]`` in the compute dtype, ``decay`` a float,
    ``[N, 1]`` or ``[N, T]`` (checked); while ``torch.compile`` traces, the operator
    ``rlops::reverse_scan`` (an explicit method checked at trace time).
    """
    case = case_of(x, decay)
    if torch.compiler.is_compiling():
        if method != "auto":
            SCAN.method(method, case)
        return reverse_scan_op(x, decay, method, chunk_size)
    return SCAN(method, case, x, decay, chunk_size)
