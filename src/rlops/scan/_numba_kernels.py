"""numba kernels behind :mod:`rlops.scan.compiled` (imported only when numba is installed).

Every kernel is a top-level function, so numba's on-disk cache (``cache=True``) keeps each one
(and each of its type signatures) apart and later processes load them instead of compiling.

Four rows at a time ("lanes"), the carries in registers: four independent chains keep the
multiply-add pipeline busy and the loop runs at memory bandwidth. ``rows`` holds the four row
indices. Carries are float64 (free on a latency-bound loop; accurate over 128K steps). A decay
of exactly 0 selects the carry away (``0 * NaN`` would be NaN), so it is an exact cut.
"""

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


@_jit
def scan_rows(x, w, y, rows):
    # y[n, t] = x[n, t] + w[n] * y[n, t+1]; w (float64) constant along time and never 0
    # (the caller copies rows whose decay is 0: y = x).
    i0, i1, i2, i3 = rows
    x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
    y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
    w0, w1, w2, w3 = w[i0], w[i1], w[i2], w[i3]
    c0 = c1 = c2 = c3 = np.float64(0)
    for t in range(x.shape[1] - 1, -1, -1):
        c0 = x0[t] + w0 * c0
        c1 = x1[t] + w1 * c1
        c2 = x2[t] + w2 * c2
        c3 = x3[t] + w3 * c3
        y0[t] = c0
        y1[t] = c1
        y2[t] = c2
        y3[t] = c3


@_jit
def scan_tokens(x, a, y, rows):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1]
    i0, i1, i2, i3 = rows
    x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
    a0, a1, a2, a3 = a[i0], a[i1], a[i2], a[i3]
    y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
    zero = np.float64(0)
    c0 = c1 = c2 = c3 = zero
    for t in range(x.shape[1] - 1, -1, -1):
        c0 = x0[t] + (a0[t] * c0 if a0[t] != 0 else zero)
        c1 = x1[t] + (a1[t] * c1 if a1[t] != 0 else zero)
        c2 = x2[t] + (a2[t] * c2 if a2[t] != 0 else zero)
        c3 = x3[t] + (a3[t] * c3 if a3[t] != 0 else zero)
        y0[t] = c0
        y1[t] = c1
        y2[t] = c2
        y3[t] = c3
