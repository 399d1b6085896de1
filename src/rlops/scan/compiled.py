"""Compiled single-pass CPU kernels (numba, an optional extra: ``pip install rlops[fast]``).

One pass over the data: the time loop runs backwards over four rows at once, so four
independent multiply-add chains are in flight instead of one latency-bound chain.
The kernels release the GIL and are single-threaded (numba's own thread pool fights torch's
OpenMP threads for the cores); large inputs are split by rows over a few Python threads.

GAE and discounted returns are fused into one kernel: mask skipping, episode ends and the
next-action value are handled in the same pass, so nothing but the outputs is written.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["available", "gae_compiled", "require", "scan_compiled"]

_LANES = 4
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


def require(x: torch.Tensor) -> None:
    if not available():
        raise ValueError(
            'method="compiled" needs numba: pip install "rlops[fast]" (or use method="chunked")'
        )
    if x.device.type != "cpu":
        raise ValueError(f'method="compiled" runs on CPU tensors, got device {x.device}')


@functools.cache
def _kernels():
    numba = _numba()
    jit = numba.njit(cache=True, nogil=True)

    # Four rows at a time ("lanes"), the carries in registers: four independent chains keep the
    # multiply-add pipeline busy and the loop runs at memory bandwidth. ``rows`` holds the four
    # row indices; a short last group repeats its last row (same values written twice).

    @jit
    def scan_rows(x, w, y, rows):
        # y[n, t] = x[n, t] + w[n] * y[n, t+1]; w constant along time.
        i0, i1, i2, i3 = rows
        x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
        y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
        w0, w1, w2, w3 = w[i0], w[i1], w[i2], w[i3]
        c0 = c1 = c2 = c3 = y.dtype.type(0)
        for t in range(x.shape[1] - 1, -1, -1):
            c0 = x0[t] + w0 * c0
            c1 = x1[t] + w1 * c1
            c2 = x2[t] + w2 * c2
            c3 = x3[t] + w3 * c3
            y0[t] = c0
            y1[t] = c1
            y2[t] = c2
            y3[t] = c3

    @jit
    def scan_tokens(x, a, y, rows):
        # y[n, t] = x[n, t] + a[n, t] * y[n, t+1]
        i0, i1, i2, i3 = rows
        x0, x1, x2, x3 = x[i0], x[i1], x[i2], x[i3]
        a0, a1, a2, a3 = a[i0], a[i1], a[i2], a[i3]
        y0, y1, y2, y3 = y[i0], y[i1], y[i2], y[i3]
        c0 = c1 = c2 = c3 = y.dtype.type(0)
        for t in range(x.shape[1] - 1, -1, -1):
            c0 = x0[t] + a0[t] * c0
            c1 = x1[t] + a1[t] * c1
            c2 = x2[t] + a2[t] * c2
            c3 = x3[t] + a3[t] * c3
            y0[t] = c0
            y1[t] = c1
            y2[t] = c2
            y3[t] = c3

    return scan_rows, scan_tokens


@functools.cache
def _gae_kernel(has_values: bool, has_mask: bool, has_dones: bool):
    """GAE over action tokens for one group of four rows, specialised on which inputs exist.

    State per row: (value, advantage) of the next action token. A done clears it before its
    token; a mask-0 token passes it through and outputs 0. Without values: discounted returns.
    The flags are compile-time constants, so absent inputs cost nothing in the loop.
    """
    numba = _numba()

    @numba.njit(inline="always")
    def step(t, r, v, m, d, e, o, g, gl, nxt, acc):
        # One token of one row, written with selects (one exit, no data-dependent branch).
        zero = o.dtype.type(0)
        if has_dones:
            cut = d[t]
            nxt = zero if cut else nxt
            acc = zero if cut else acc
        vt = v[t] if has_values else zero
        a = (r[t] + g * nxt - vt) + gl * acc
        if has_mask:
            act = m[t]
            o[t] = a + vt if act else zero
            if has_values:
                e[t] = a if act else zero
            return (vt if act else nxt), (a if act else acc)
        o[t] = a + vt
        if has_values:
            e[t] = a
        return vt, a

    @numba.njit(cache=True, nogil=True)
    def gae(r, v, mask, dones, g, gl, adv, ret, rows):
        i0, i1, i2, i3 = rows
        r0, r1, r2, r3 = r[i0], r[i1], r[i2], r[i3]
        v0, v1, v2, v3 = v[i0], v[i1], v[i2], v[i3]
        m0, m1, m2, m3 = mask[i0], mask[i1], mask[i2], mask[i3]
        d0, d1, d2, d3 = dones[i0], dones[i1], dones[i2], dones[i3]
        e0, e1, e2, e3 = adv[i0], adv[i1], adv[i2], adv[i3]
        o0, o1, o2, o3 = ret[i0], ret[i1], ret[i2], ret[i3]
        g0, g1, g2, g3 = g[i0], g[i1], g[i2], g[i3]
        l0, l1, l2, l3 = gl[i0], gl[i1], gl[i2], gl[i3]
        n0 = n1 = n2 = n3 = a0 = a1 = a2 = a3 = ret.dtype.type(0)
        for t in range(r.shape[1] - 1, -1, -1):
            n0, a0 = step(t, r0, v0, m0, d0, e0, o0, g0, l0, n0, a0)
            n1, a1 = step(t, r1, v1, m1, d1, e1, o1, g1, l1, n1, a1)
            n2, a2 = step(t, r2, v2, m2, d2, e2, o2, g2, l2, n2, a2)
            n3, a3 = step(t, r3, v3, m3, d3, e3, o3, g3, l3, n3, a3)

    return gae


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="rlops-scan")


def _run(kernel, n_rows: int, n_elements: int, *args) -> None:
    """Run ``kernel(*args, rows)`` over groups of 4 rows, on several threads when it pays."""
    groups = [
        tuple(min(r + k, n_rows - 1) for k in range(_LANES)) for r in range(0, n_rows, _LANES)
    ]
    threads = min(torch.get_num_threads(), n_elements // _MIN_ELEMENTS_PER_THREAD, len(groups))
    if threads <= 1:
        for rows in groups:
            kernel(*args, rows)
        return
    per = -(-len(groups) // threads)
    parts = [groups[i : i + per] for i in range(0, len(groups), per)]

    def work(part):
        for rows in part:
            kernel(*args, rows)

    list(_pool(threads).map(work, parts))


def _array(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> np.ndarray:
    """``t`` as a contiguous ``[N, T]`` array; a missing input is an unread ``[N, 1]`` stand-in."""
    if t is None:
        return np.zeros((n, 1), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    return t.to(dtype).contiguous().numpy()


def scan_compiled(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]`` (float32/64, CPU); ``decay`` a float, [N, 1] or [N, T]."""
    x = x.contiguous()
    n, t_len = x.shape
    y = torch.empty_like(x)
    if n == 0 or t_len == 0:
        return y
    scan_rows, scan_tokens = _kernels()
    if isinstance(decay, torch.Tensor) and decay.shape[-1] == t_len and t_len > 1:
        a = decay.to(x.dtype).expand(n, t_len).contiguous()
        _run(scan_tokens, n, x.numel(), x.numpy(), a.numpy(), y.numpy())
    else:
        if isinstance(decay, torch.Tensor):
            w = decay.to(x.dtype).reshape(-1).expand(n).contiguous()
        else:
            w = torch.full((n,), float(decay), dtype=x.dtype)
        _run(scan_rows, n, x.numel(), x.numpy(), w.numpy(), y.numpy())
    return y


def gae_compiled(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    dones: torch.Tensor | None,
    gamma: torch.Tensor,
    gamma_lam: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused GAE in one pass; with ``values=None``, discounted returns (pass ``gamma_lam=gamma``).

    ``rewards``/``values`` ``[N, T]`` in the compute dtype (float32/64, CPU); ``mask``/``dones``
    ``[N, T]`` 0/1 or None; ``gamma``/``gamma_lam`` ``[N]``. Returns ``(advantages, returns)``;
    without values both are the same tensor.
    """
    rewards = rewards.contiguous()
    n, t_len = rewards.shape
    ret = torch.empty_like(rewards)
    adv = ret if values is None else torch.empty_like(rewards)
    if n == 0 or t_len == 0:
        return adv, ret
    kernel = _gae_kernel(values is not None, mask is not None, dones is not None)
    _run(
        kernel,
        n,
        rewards.numel(),
        rewards.numpy(),
        _array(values, n, rewards.dtype),
        _array(mask, n, torch.bool),
        _array(dones, n, torch.bool),
        gamma.to(rewards.dtype).expand(n).contiguous().numpy(),
        gamma_lam.to(rewards.dtype).expand(n).contiguous().numpy(),
        adv.numpy(),
        ret.numpy(),
    )
    return adv, ret
