"""numba kernels behind :mod:`rlops.scan.compiled` (imported only when numba is installed): each
a top-level function (numba's on-disk cache keeps them apart), four rows at a time, float64
carries advanced by one fused multiply-add (docs/design/scan.md).
"""

import numba
import numpy as np

from rlops.scan.exact_arith import fma, lanes, set_llvm_optsize

_jit = numba.njit(cache=True, nogil=True)


@_jit
def scan_rows(x, w, y, rows):
    # y[n, t] = x[n, t] + w[n] * y[n, t+1]; the decay constant along time, float64, never 0.
    set_llvm_optsize()
    x0, x1, x2, x3 = lanes(x, rows)
    y0, y1, y2, y3 = lanes(y, rows)
    w0, w1, w2, w3 = lanes(w, rows)
    c0 = c1 = c2 = c3 = np.float64(0)
    out = y.dtype.type
    for t in range(x.shape[1] - 1, -1, -1):
        c0 = fma(w0, c0, np.float64(x0[t]))
        c1 = fma(w1, c1, np.float64(x1[t]))
        c2 = fma(w2, c2, np.float64(x2[t]))
        c3 = fma(w3, c3, np.float64(x3[t]))
        y0[t] = out(c0)
        y1[t] = out(c1)
        y2[t] = out(c2)
        y3[t] = out(c3)


@numba.njit(inline="always")
def _token(xt, at, c, cut):
    # one step of a per-token scan; with ``cut`` the carry is selected away where the decay is 0
    a = np.float64(at)
    return fma(a, (c if a != 0 else 0.0) if cut else c, np.float64(xt))


@numba.njit(inline="always")
def _tokens(x, a, y, rows, cut):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1]; returns the sum of the carries
    x0, x1, x2, x3 = lanes(x, rows)
    a0, a1, a2, a3 = lanes(a, rows)
    y0, y1, y2, y3 = lanes(y, rows)
    c0 = c1 = c2 = c3 = np.float64(0)
    s0 = s1 = s2 = s3 = np.float64(0)
    out = y.dtype.type
    for t in range(x.shape[1] - 1, -1, -1):
        c0 = _token(x0[t], a0[t], c0, cut)
        c1 = _token(x1[t], a1[t], c1, cut)
        c2 = _token(x2[t], a2[t], c2, cut)
        c3 = _token(x3[t], a3[t], c3, cut)
        s0 += c0
        s1 += c1
        s2 += c2
        s3 += c3
        y0[t] = out(c0)
        y1[t] = out(c1)
        y2[t] = out(c2)
        y3[t] = out(c3)
    return (s0 + s1) + (s2 + s3)


@_jit
def _tokens_fast(x, a, y, rows):
    set_llvm_optsize()
    return _tokens(x, a, y, rows, False)


@_jit
def _tokens_cut(x, a, y, rows):
    set_llvm_optsize()
    return _tokens(x, a, y, rows, True)


@_jit
def scan_tokens(x, a, y, rows):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1], a decay of 0 an exact cut
    if not np.isfinite(_tokens_fast(x, a, y, rows)):
        _tokens_cut(x, a, y, rows)
