"""numba kernels behind :mod:`rlops.scan.compiled` (imported only when numba is installed).

Every kernel is a top-level function, so numba's on-disk cache (``cache=True``) keeps each one
(and each of its type signatures) apart and later processes load them instead of compiling.

Four rows at a time ("lanes"), the carries in registers: four independent chains keep the
multiply-add pipeline busy. ``rows`` holds the four row indices. Each carry is compensated:
``c`` stays on the latency chain (one multiply, one add, as an uncompensated loop) and ``e``
collects the exact rounding error of the product and the sum (:func:`two_prod`,
:func:`two_sum`) and the low word of a float64 decay, so a float32 scan over 128K steps keeps
about the accuracy of a float64 one. A per-token decay of exactly 0 selects the carry away
(``0 * NaN`` would be NaN), so it is an exact cut; rows whose constant decay is 0 are copied by
the caller.
"""

import numba

from rlops.scan.exact_arith import fast_two_sum, two_prod


@numba.njit(inline="always")
def _row(xt, w, wl, c, e):
    # c' + e' = xt + (w + wl) * (c + e): c' on the chain, every rounding error into e'
    p, pe = two_prod(w, c)
    s, se = fast_two_sum(p, xt)
    return s, w * e + (se + (pe + wl * c))


_jit = numba.njit(cache=True, nogil=True)


@_jit
def scan_rows(x, w, wl, y, rows):
    # y[n, t] = x[n, t] + (w[n] + wl[n]) * y[n, t+1]; the decay, constant along time and never
    # 0, in two words (``wl`` the part of a float64 decay that ``w`` cannot hold).
    i0, i1, i2, i3 = rows
    x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
    y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
    w0, w1, w2, w3 = w[i0], w[i1], w[i2], w[i3]
    v0, v1, v2, v3 = wl[i0], wl[i1], wl[i2], wl[i3]
    c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = y.dtype.type(0)
    for t in range(x.shape[1] - 1, -1, -1):
        c0, e0 = _row(x0[t], w0, v0, c0, e0)
        c1, e1 = _row(x1[t], w1, v1, c1, e1)
        c2, e2 = _row(x2[t], w2, v2, c2, e2)
        c3, e3 = _row(x3[t], w3, v3, c3, e3)
        y0[t] = c0 + e0
        y1[t] = c1 + e1
        y2[t] = c2 + e2
        y3[t] = c3 + e3


@numba.njit(inline="always")
def _token(xt, at, c, e, zero):
    # one step of a per-token scan: the carry (c, e) is selected away where the decay is 0
    keep = at != 0
    p, pe = two_prod(at, c)
    s, se = fast_two_sum(p if keep else zero, xt)
    return s, (at * e + pe if keep else zero) + se


@_jit
def scan_tokens(x, a, y, rows):
    # y[n, t] = x[n, t] + a[n, t] * y[n, t+1]
    i0, i1, i2, i3 = rows
    x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
    a0, a1, a2, a3 = a[i0], a[i1], a[i2], a[i3]
    y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
    zero = y.dtype.type(0)
    c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = zero
    for t in range(x.shape[1] - 1, -1, -1):
        c0, e0 = _token(x0[t], a0[t], c0, e0, zero)
        c1, e1 = _token(x1[t], a1[t], c1, e1, zero)
        c2, e2 = _token(x2[t], a2[t], c2, e2, zero)
        c3, e3 = _token(x3[t], a3[t], c3, e3, zero)
        y0[t] = c0 + e0
        y1[t] = c1 + e1
        y2[t] = c2 + e2
        y3[t] = c3 + e3
