"""numba kernels behind :mod:`rlops.advantages.compiled` (imported only when numba is installed).

GAE, discounted returns and REINFORCE++ returns fused with mask skipping, dones, the
next-action value and the bootstrap in one backward pass, four rows at a time (masked GAE in
bfloat16: two), the advantage carry in float64 (docs/design/scan.md, docs/design/masks.md).
One top-level kernel per combination of inputs, so numba's on-disk cache keeps them apart.
"""

import numba
import numpy as np

from rlops.scan.exact_arith import (
    fma,
    group,
    lanes,
    load,
    narrow,
    rounded,
    set_llvm_optsize,
    store,
)

_jit = numba.njit(cache=True, nogil=True)
# one group of four rows, compiled apart from the loop over groups that calls it (``gae_*``,
# ``returns_kl``): inlined into that loop, LLVM schedules the time loop worse
_kernel = numba.njit(nogil=True)


@numba.njit(inline="always")
def step(t, r, v, m, d, c, e, o, g, gl, nxt, acc, has_values, has_mask, has_dones, has_cut):
    # One token of one row; ``acc`` is the float64 advantage (or return) carry, ``nxt`` the
    # value of the next action token and ``g`` gamma (both in the arithmetic dtype, as the TD
    # residual of every other method), ``gl`` gamma * lam in float64 (0.999 is not a float32:
    # the carry decays by the exact value). Without values the residual is the reward itself
    # (``r + g * 0 - 0`` up to the sign of 0) and the return is the carry. ``c`` the value
    # after each end (``has_cut``). bfloat16 arrays are their bits, computed in float32. The
    # mask is branched on: masks come in runs (padding, tool output), which predict well.
    zero = narrow(o, 0.0)
    if has_dones:
        if d[t]:  # replaced, never multiplied by 0
            if has_values:
                nxt = c[t] if has_cut else zero
                acc = 0.0
            else:
                acc = np.float64(c[t]) if has_cut else 0.0
    if (not has_mask) or m[t]:
        if has_values:
            vt = load(v, t)
            acc = fma(gl, acc, np.float64(load(r, t) + g * nxt - vt))
            out = narrow(o, acc)
            store(o, t, out + vt)
            store(e, t, out)
            nxt = vt
        else:
            acc = fma(gl, acc, np.float64(load(r, t)))
            store(o, t, narrow(o, acc))
    else:  # a mask-0 token: 0 out, the carries pass through
        store(o, t, zero)
        if has_values:
            store(e, t, zero)
    return nxt, acc


@numba.njit(inline="always")
def body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, hv, hm, hd, hc):
    r0, r1, r2, r3 = lanes(r, rows)
    v0, v1, v2, v3 = lanes(v, rows)
    m0, m1, m2, m3 = lanes(mask, rows)
    d0, d1, d2, d3 = lanes(dones, rows)
    c0, c1, c2, c3 = lanes(cut, rows)
    e0, e1, e2, e3 = lanes(adv, rows)
    o0, o1, o2, o3 = lanes(ret, rows)
    g0, g1, g2, g3 = lanes(g, rows)
    l0, l1, l2, l3 = lanes(gl, rows)
    if hv:  # the row's end value starts the next-value carry (GAE) or the return (returns)
        n0, n1, n2, n3 = lanes(init, rows)
        a0 = a1 = a2 = a3 = np.float64(0)
    else:
        n0 = n1 = n2 = n3 = narrow(ret, 0.0)
        b0, b1, b2, b3 = lanes(init, rows)
        a0, a1, a2, a3 = np.float64(b0), np.float64(b1), np.float64(b2), np.float64(b3)
    for t in range(r.shape[1] - 1, -1, -1):
        n0, a0 = step(t, r0, v0, m0, d0, c0, e0, o0, g0, l0, n0, a0, hv, hm, hd, hc)
        n1, a1 = step(t, r1, v1, m1, d1, c1, e1, o1, g1, l1, n1, a1, hv, hm, hd, hc)
        n2, a2 = step(t, r2, v2, m2, d2, c2, e2, o2, g2, l2, n2, a2, hv, hm, hd, hc)
        n3, a3 = step(t, r3, v3, m3, d3, c3, e3, o3, g3, l3, n3, a3, hv, hm, hd, hc)


@_kernel
def _gae_0000(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, False, False, False)


@_jit
def gae_0000(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0000(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_0010(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, False, True, False)


@_jit
def gae_0010(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0010(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_0011(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, False, True, True)


@_jit
def gae_0011(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0011(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_0100(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, True, False, False)


@_jit
def gae_0100(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0100(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_0110(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, True, True, False)


@_jit
def gae_0110(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0110(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_0111(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, False, True, True, True)


@_jit
def gae_0111(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_0111(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1000(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, False, False, False)


@_jit
def gae_1000(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1000(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1010(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, False, True, False)


@_jit
def gae_1010(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1010(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1011(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, False, True, True)


@_jit
def gae_1011(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1011(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1100(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, True, False, False)


@_jit
def gae_1100(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1100(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1110(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, True, True, False)


@_jit
def gae_1110(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1110(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _gae_1111(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    body(r, v, mask, dones, cut, init, g, gl, adv, ret, rows, True, True, True, True)


@_jit
def gae_1111(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _gae_1111(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


#: ``(values, mask, dones, cut)`` -> the kernel for those inputs: the digits of its name
GAE = {
    tuple(digit == "1" for digit in name[4:]): kernel
    for name, kernel in globals().items()
    if name.startswith("gae_")
}


@numba.njit(inline="always")
def select_step(t, r, v, m, d, c, e, o, g, gl, nxt, acc, has_dones, has_cut):
    # ``step`` with values and a mask, the mask a select: in bfloat16 (bits) ``step``'s mask
    # branch on four rows spills their row pointers (3x slower than this on two rows). The
    # outputs are named before the stores: numba 0.68 drops a store whose value is written as
    # a conditional expression in the call.
    zero = np.float32(0)
    if has_dones:
        if d[t]:
            nxt = c[t] if has_cut else zero
            acc = 0.0
    vt = load(v, t)
    new = fma(gl, acc, np.float64(load(r, t) + g * nxt - vt))
    out = narrow(o, new)
    keep = m[t]
    adv_t = out if keep else zero
    ret_t = out + vt if keep else zero
    store(e, t, adv_t)
    store(o, t, ret_t)
    return (vt if keep else nxt), (new if keep else acc)


@numba.njit(inline="always")
def pair(r, v, mask, dones, cut, init, g, gl, adv, ret, i, j, hd, hc):
    # rows i and j of masked bfloat16 GAE
    r0, r1, v0, v1, m0, m1 = r[i], r[j], v[i], v[j], mask[i], mask[j]
    d0, d1, c0, c1 = dones[i], dones[j], cut[i], cut[j]
    e0, e1, o0, o1 = adv[i], adv[j], ret[i], ret[j]
    g0, g1, l0, l1, n0, n1 = g[i], g[j], gl[i], gl[j], init[i], init[j]
    a0 = a1 = np.float64(0)
    for t in range(r.shape[1] - 1, -1, -1):
        n0, a0 = select_step(t, r0, v0, m0, d0, c0, e0, o0, g0, l0, n0, a0, hd, hc)
        n1, a1 = select_step(t, r1, v1, m1, d1, c1, e1, o1, g1, l1, n1, a1, hd, hc)


@_kernel
def _masked_bf16_00(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[0], rows[1], False, False)
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[2], rows[3], False, False)


@_jit
def masked_bf16_00(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _masked_bf16_00(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _masked_bf16_10(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[0], rows[1], True, False)
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[2], rows[3], True, False)


@_jit
def masked_bf16_10(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _masked_bf16_10(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


@_kernel
def _masked_bf16_11(r, v, mask, dones, cut, init, g, gl, adv, ret, rows):
    set_llvm_optsize()
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[0], rows[1], True, True)
    pair(r, v, mask, dones, cut, init, g, gl, adv, ret, rows[2], rows[3], True, True)


@_jit
def masked_bf16_11(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop):
    for k in range(start, stop):
        _masked_bf16_11(r, v, mask, dones, cut, init, g, gl, adv, ret, group(k, r.shape[0]))


#: GAE with values and a mask on bfloat16 bits, two rows at a time: ``(dones, cut)`` -> kernel
MASKED_BF16 = {
    (name[-2] == "1", name[-1] == "1"): kernel
    for name, kernel in globals().items()
    if name.startswith("masked_bf16_")
}


@numba.njit(inline="always")
def kl_step(t, kl, m, o, ck, gl, pend, acc):
    # One token of REINFORCE++ returns: the reward is ``ck * kl[t]`` (``ck = -kl_coef`` in the
    # arithmetic dtype), plus the outcome ``pend`` on the row's last action token, the first one
    # met walking back (``pend`` is 0 after it); mask-0 tokens pass the carry through. In
    # bfloat16 (bits) the product is rounded to bfloat16, and its sum with the outcome again,
    # as the two-step form writes them (adding a 0 outcome turns -0 to +0 only: the carry,
    # never -0, moves the same).
    zero = narrow(o, 0.0)
    if m[t]:
        reward = rounded(o, ck * load(kl, t)) + pend
        if pend != zero:  # a no-op in full precision
            reward = rounded(o, reward)
        acc = fma(gl, acc, np.float64(reward))
        store(o, t, narrow(o, acc))
        pend = zero
    else:
        store(o, t, zero)
    return pend, acc


@_kernel
def _returns_kl(kl, outcome, ck, mask, gl, ret, rows):
    set_llvm_optsize()
    k0, k1, k2, k3 = lanes(kl, rows)
    m0, m1, m2, m3 = lanes(mask, rows)
    o0, o1, o2, o3 = lanes(ret, rows)
    p0, p1, p2, p3 = lanes(outcome, rows)
    l0, l1, l2, l3 = lanes(gl, rows)
    c = ck[0]
    a0 = a1 = a2 = a3 = np.float64(0)
    for t in range(kl.shape[1] - 1, -1, -1):
        p0, a0 = kl_step(t, k0, m0, o0, c, l0, p0, a0)
        p1, a1 = kl_step(t, k1, m1, o1, c, l1, p1, a1)
        p2, a2 = kl_step(t, k2, m2, o2, c, l2, p2, a2)
        p3, a3 = kl_step(t, k3, m3, o3, c, l3, p3, a3)


@_jit
def returns_kl(kl, outcome, ck, mask, gl, ret, start, stop):
    # ret[n, t] = REINFORCE++ return; ``outcome`` [N] and ``ck`` in the arithmetic dtype, ``gl`` [N]
    # the float64 discount (never 0: such rows go to the chunked method).
    for k in range(start, stop):
        _returns_kl(kl, outcome, ck, mask, gl, ret, group(k, kl.shape[0]))
