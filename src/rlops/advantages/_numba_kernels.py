"""numba kernels behind :mod:`rlops.advantages.compiled` (imported only when numba is installed).

GAE and discounted returns fused with mask skipping, dones and the next-action value, in one
backward pass over time, four rows at a time with the carries in registers. The rules are
those of :mod:`rlops.advantages.masking`, applied token by token with selects: at a done the
carries are *replaced* by 0 (never multiplied), so nothing crosses it, not even NaN.

The advantage carry is compensated (:mod:`rlops.scan.exact_arith`):
a high word on the latency chain and a low word that collects the exact rounding error of
the carry's product and sum off it, so a float32 carry over 128K tokens is about as accurate
as a float64 one.

One top-level kernel per combination of inputs (values, mask, dones), so numba's on-disk cache
keeps them apart and later processes load them instead of compiling.
"""

import numba

from rlops.scan.exact_arith import fast_two_sum, two_prod

_jit = numba.njit(cache=True, nogil=True)


@numba.njit(inline="always")
def step(t, r, v, m, d, e, o, g, gl, gw, lw, nxt, hi, lo, has_values, has_mask, has_dones):
    # One token of one row, written with selects (no data-dependent branch); ``hi + lo`` is the
    # advantage (or return) carry, ``nxt`` the value of the next action token; ``gw``/``lw``
    # the low words of gamma and gamma * lam (what a float32 discount cannot hold).
    zero = o.dtype.type(0)
    if has_dones:
        cut = d[t]
        nxt = zero if cut else nxt
        hi = zero if cut else hi
        lo = zero if cut else lo
    vt = v[t] if has_values else zero
    # delta = r + g * nxt - v and a = delta + gl * (hi + lo), every rounding error into ``low``
    # a = delta + (gl + lw) * (hi + lo): the sum's and the product's rounding errors, and
    # the low word of the decay, go into ``low`` (the TD residual's own rounding does not
    # accumulate along the chain and is left as is)
    p, pe = two_prod(gl, hi)
    s, se = fast_two_sum(p, r[t] + g * nxt - vt)
    low = gl * lo + (se + (pe + (lw * hi + gw * nxt)))
    a = s + low
    if has_mask:
        act = m[t]
        o[t] = (a + vt) if act else zero
        if has_values:
            e[t] = a if act else zero
        return (vt if act else nxt), (s if act else hi), (low if act else lo)
    o[t] = a + vt
    if has_values:
        e[t] = a
    return vt, s, low


@numba.njit(inline="always")
def body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, hv, hm, hd):
    i0, i1, i2, i3 = rows
    r0, r1, r2, r3 = r[i0], r[i1], r[i2], r[i3]
    v0, v1, v2, v3 = v[i0], v[i1], v[i2], v[i3]
    m0, m1, m2, m3 = mask[i0], mask[i1], mask[i2], mask[i3]
    d0, d1, d2, d3 = dones[i0], dones[i1], dones[i2], dones[i3]
    e0, e1, e2, e3 = adv[i0], adv[i1], adv[i2], adv[i3]
    o0, o1, o2, o3 = ret[i0], ret[i1], ret[i2], ret[i3]
    g0, g1, g2, g3 = g[i0], g[i1], g[i2], g[i3]
    l0, l1, l2, l3 = gl[i0], gl[i1], gl[i2], gl[i3]
    x0, x1, x2, x3 = gw[i0], gw[i1], gw[i2], gw[i3]
    y0, y1, y2, y3 = lw[i0], lw[i1], lw[i2], lw[i3]
    n0 = n1 = n2 = n3 = h0 = h1 = h2 = h3 = w0 = w1 = w2 = w3 = ret.dtype.type(0)
    for t in range(r.shape[1] - 1, -1, -1):
        n0, h0, w0 = step(t, r0, v0, m0, d0, e0, o0, g0, l0, x0, y0, n0, h0, w0, hv, hm, hd)
        n1, h1, w1 = step(t, r1, v1, m1, d1, e1, o1, g1, l1, x1, y1, n1, h1, w1, hv, hm, hd)
        n2, h2, w2 = step(t, r2, v2, m2, d2, e2, o2, g2, l2, x2, y2, n2, h2, w2, hv, hm, hd)
        n3, h3, w3 = step(t, r3, v3, m3, d3, e3, o3, g3, l3, x3, y3, n3, h3, w3, hv, hm, hd)


@_jit
def gae_000(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, False, False, False)


@_jit
def gae_001(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, False, False, True)


@_jit
def gae_010(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, False, True, False)


@_jit
def gae_011(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, False, True, True)


@_jit
def gae_100(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, True, False, False)


@_jit
def gae_101(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, True, False, True)


@_jit
def gae_110(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, True, True, False)


@_jit
def gae_111(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows):
    body(r, v, mask, dones, g, gl, gw, lw, adv, ret, rows, True, True, True)


GAE = {
    (False, False, False): gae_000,
    (False, False, True): gae_001,
    (False, True, False): gae_010,
    (False, True, True): gae_011,
    (True, False, False): gae_100,
    (True, False, True): gae_101,
    (True, True, False): gae_110,
    (True, True, True): gae_111,
}
