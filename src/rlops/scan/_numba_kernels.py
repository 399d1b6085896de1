"""The per-token scan's numba kernels behind :mod:`rlops.scan.compiled` (imported only when
numba is installed; a decay per row, and the estimators: :mod:`rlops.scan.tiles`): each
a top-level function (numba's on-disk cache keeps them apart) running the groups of four rows
``start`` to ``stop`` one after the other, each group a function of its own; float64 carries
advanced by one fused multiply-add; bfloat16 arrays are their bits, computed in float32
(docs/design/scan.md).
"""

import numba
import numpy as np

from rlops.scan._cache import njit
from rlops.scan.exact_arith import fma, group, lanes, load, narrow, set_llvm_optsize, store

_jit = njit(nogil=True)  # cached on disk, saves locked across processes
_kernel = numba.njit(nogil=True)  # one group, compiled apart from the loop over groups


@numba.njit(inline="always")
def _token(xt, at, c, cut):
    # one step of a per-token scan; with ``cut`` the carry is selected away where the decay is 0
    a = np.float64(at)
    return fma(a, (c if a != 0 else 0.0) if cut else c, np.float64(xt))


@numba.njit(inline="always")
def _tokens(x, a, y, rows, cut):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1] on one group; returns the sum of the carries
    x0, x1, x2, x3 = lanes(x, rows)
    a0, a1, a2, a3 = lanes(a, rows)
    y0, y1, y2, y3 = lanes(y, rows)
    c0 = c1 = c2 = c3 = np.float64(0)
    s0 = s1 = s2 = s3 = np.float64(0)
    for t in range(x.shape[1] - 1, -1, -1):
        c0 = _token(load(x0, t), load(a0, t), c0, cut)
        c1 = _token(load(x1, t), load(a1, t), c1, cut)
        c2 = _token(load(x2, t), load(a2, t), c2, cut)
        c3 = _token(load(x3, t), load(a3, t), c3, cut)
        s0 += c0
        s1 += c1
        s2 += c2
        s3 += c3
        store(y0, t, narrow(y, c0))
        store(y1, t, narrow(y, c1))
        store(y2, t, narrow(y, c2))
        store(y3, t, narrow(y, c3))
    return (s0 + s1) + (s2 + s3)


@_kernel
def _tokens_fast(x, a, y, rows):
    set_llvm_optsize()
    return _tokens(x, a, y, rows, False)


@_kernel
def _tokens_cut(x, a, y, rows):
    set_llvm_optsize()
    return _tokens(x, a, y, rows, True)


@_jit
def scan_tokens(x, a, y, start, stop):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1], a decay of 0 an exact cut: a group whose carries
    # do not sum to a finite number is scanned again with the select
    for k in range(start, stop):
        rows = group(k, x.shape[0])
        if not np.isfinite(_tokens_fast(x, a, y, rows)):
            _tokens_cut(x, a, y, rows)
