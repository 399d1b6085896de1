"""Compiled single-pass CPU scan (numba, the ``fast`` extra), four rows at once with float64
carries; large inputs split by rows over :mod:`rlops._threads` (:func:`run_rows`, shared with
the estimators' kernels). numba and numpy are imported on first use only.
"""

from __future__ import annotations

import functools

import torch

from rlops._threads import for_each
from rlops.scan.decay import is_per_token

__all__ = ["LANES", "as_array", "available", "run_rows", "scan_compiled"]

LANES = 4
_MIN_ELEMENTS_PER_THREAD = 1 << 17


@functools.cache
def _numba():
    try:
        import numba
    except ImportError:
        return None
    return numba


def available() -> bool:
    """Whether numba can be imported (the ``fast`` extra)."""
    return _numba() is not None


def run_rows(kernel, n_rows: int, n_elements: int, *args) -> None:
    """Run ``kernel(*args, rows)`` over groups of 4 rows, on several threads when it pays.
    A short last group repeats its last row (the same values are written twice)."""
    groups = [tuple(min(r + k, n_rows - 1) for k in range(LANES)) for r in range(0, n_rows, LANES)]
    threads = min(torch.get_num_threads(), n_elements // _MIN_ELEMENTS_PER_THREAD, len(groups))
    per = -(-len(groups) // max(threads, 1))
    parts = [groups[i : i + per] for i in range(0, len(groups), per)]

    def work(part):
        for rows in part:
            kernel(*args, rows)

    for_each(work, parts, torch.device("cpu"))


def as_array(t: torch.Tensor | None, n: int, dtype: torch.dtype):
    """``t`` as a contiguous ``[N, T]`` numpy array of ``dtype``; a missing input is an unread
    ``[N, 1]`` stand-in of zeros."""
    if t is None:
        return torch.zeros((n, 1), dtype=dtype).numpy()
    return t.to(dtype).contiguous().numpy()


def scan_compiled(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]`` (float32/64, CPU); ``decay`` a float, [N, 1] or [N, T].

    Per-row decays are passed in float64 (the carry's dtype), per-token decays in ``x``'s
    dtype."""
    from rlops.scan import _numba_kernels as k

    x = x.contiguous()
    n, t_len = x.shape
    y = torch.empty_like(x)
    if n == 0 or t_len == 0:
        return y
    if is_per_token(decay, t_len):
        a = decay.to(x.dtype).expand(n, t_len).contiguous()
        run_rows(k.scan_tokens, n, x.numel(), x.numpy(), a.numpy(), y.numpy())
    else:
        if isinstance(decay, torch.Tensor):
            w = decay.reshape(-1).expand(n)
        else:
            w = torch.full((n,), float(decay), dtype=torch.float64)
        wide = w.to(torch.float64).contiguous().numpy()
        run_rows(k.scan_rows, n, x.numel(), x.numpy(), wide, y.numpy())
        cut = w == 0  # a zero decay is an exact cut: y = x, whatever follows (even NaN)
        if bool(cut.any()):  # a host tensor: no device synchronisation
            y[cut] = x[cut]
    return y
