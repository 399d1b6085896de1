"""GAE, discounted returns and REINFORCE++ returns as one Triton kernel each (CUDA; CPU tensors
under ``TRITON_INTERPRET=1``), forward only.

Each is a reverse scan of per-token affine maps on a state of one or two numbers (returns
``G``; GAE ``(A, W)``, ``W`` the next action token's value; REINFORCE++ ``(G, O)``), composed
with :func:`rlops.scan.triton.compose1` / ``compose2`` and run by the two-level scheme of
:mod:`rlops.scan.triton`; the rules of ``_masking.py`` token by token, the bootstrap as the
carry's start and a done's cut value (docs/design/scan.md, docs/design/masks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlops._backends import launch
from rlops._triton import acc_dtype, cast_to, tl_dtype
from rlops.advantages._masking import GaeInputs
from rlops.scan.triton import (
    block_carries,
    block_cell,
    block_head,
    block_size,
    compose1,
    compose2,
    num_warps,
    plane_size,
)

__all__ = ["gae_triton", "reinforce_returns_triton"]

RETURNS, GAE, RPP = 1, 2, 3


@triton.jit
def _estimator_block(
    r_ptr, v_ptr, m_ptr, d_ptr, cut_ptr, g_ptr, gl_ptr, ck_ptr, adv_ptr, ret_ptr, summ_ptr,
    carry_ptr, B, T, NB,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DONES: tl.constexpr, HAS_CUT: tl.constexpr,
    FINAL: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    cell, row, i, t, ok, base = block_cell(T, NB, BLOCK)
    act = ok
    if HAS_MASK:
        act = act & (tl.load(m_ptr + base + t, mask=ok, other=0) != 0)
    done = t < 0
    if HAS_DONES:
        done = ok & (tl.load(d_ptr + base + t, mask=ok, other=0) != 0)
    # loaded under the block's bounds alone (a mask known per vector: vector loads); every use
    # of a mask-0 or non-done token's value is selected away below
    r = tl.load(r_ptr + base + t, mask=ok, other=0.0)
    gamma = tl.load(g_ptr + row).to(ACC)
    zero = tl.zeros([BLOCK], ACC)
    one = zero + 1.0
    plane = plane_size(B, NB)  # int64: the fifth plane's offset 4·B·NB passes 2³¹ first
    boot = zero  # gamma * the value after a done (0 without a cut value, or where gamma is 0)
    cv = zero
    if HAS_CUT:
        cv = tl.where(done, tl.load(cut_ptr + base + t, mask=ok, other=0.0).to(ACC), zero)
        boot = gamma * tl.where(gamma == 0.0, zero, cv)
    if MODE == 1:  # discounted returns: one number of state
        p = tl.where(done, zero, tl.where(act, gamma, one))
        c = tl.where(act, r.to(ACC), zero)
        if HAS_CUT:
            c = tl.where(done, tl.where(act, c + boot, cv), c)
        p, c = tl.associative_scan((p, c), 0, compose1, reverse=True)
        if FINAL:
            a_in = tl.load(carry_ptr + cell).to(ACC)
            y = c + p * tl.where(p == 0, 0.0, a_in)
            y = tl.where(act, y, zero)
            tl.store(ret_ptr + base + t, cast_to(y, ret_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(summ_ptr + cell, block_head(p, i))
            tl.store(summ_ptr + plane + cell, block_head(c, i))
    else:
        if MODE == 2:  # GAE: (A, W = value of the next action token)
            v = tl.where(act, tl.load(v_ptr + base + t, mask=ok, other=0.0).to(ACC), zero)
            gl = tl.load(gl_ptr + row).to(ACC)
            keep = act & (done == 0)
            p = tl.where(keep, gl, tl.where(act | done, zero, one))
            q = tl.where(keep, gamma, zero)
            s = tl.where(act | done, zero, one)
            c = tl.where(act, r.to(ACC) - v, zero)
            e = tl.where(act, v, zero)
            if HAS_CUT:
                c = tl.where(done & act, c + boot, c)
                e = tl.where(act, v, tl.where(done, cv, zero))
        else:  # REINFORCE++ returns: (G, O = the outcome until the last action token)
            ck = tl.load(ck_ptr).to(ACC)
            tok = cast_to(ck * r.to(ACC), r_ptr.dtype.element_ty).to(ACC)
            p = tl.where(act, gamma, one)
            q = tl.where(act, one, zero)
            s = tl.where(act, zero, one)
            c = tl.where(act, tok, zero)
            e = zero
        p, q, s, c, e = tl.associative_scan((p, q, s, c, e), 0, compose2, reverse=True)
        if FINAL:
            a_in = tl.load(carry_ptr + cell).to(ACC)
            w_in = tl.load(carry_ptr + plane + cell).to(ACC)
            a = c + p * tl.where(p == 0, 0.0, a_in) + q * tl.where(q == 0, 0.0, w_in)
            adv = tl.where(act, a, zero)
            if MODE == 2:
                tl.store(adv_ptr + base + t, cast_to(adv, adv_ptr.dtype.element_ty), mask=ok)
                ret = tl.where(act, v + a, zero)
                tl.store(ret_ptr + base + t, cast_to(ret, ret_ptr.dtype.element_ty), mask=ok)
            else:
                tl.store(ret_ptr + base + t, cast_to(adv, ret_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(summ_ptr + cell, block_head(p, i))
            tl.store(summ_ptr + plane + cell, block_head(q, i))
            tl.store(summ_ptr + 2 * plane + cell, block_head(s, i))
            tl.store(summ_ptr + 3 * plane + cell, block_head(c, i))
            tl.store(summ_ptr + 4 * plane + cell, block_head(e, i))


def _run(mode, r, v, mask, dones, gamma, gamma_lam, ck, init, adv, ret, block_t, cut=None):
    b, t_len = r.shape
    if b == 0 or t_len == 0:
        return
    acc = init.dtype
    block = block_size(block_t)
    nb = triton.cdiv(t_len, block)
    two = mode != RETURNS
    dummy = ret
    ptrs = (
        r,
        dummy if v is None else v,
        dummy if mask is None else mask,
        dummy if dones is None else dones,
        dummy if cut is None else cut,
        gamma,
        gamma if gamma_lam is None else gamma_lam,
        gamma if ck is None else ck,
        dummy if adv is None else adv,
        ret,
    )
    flags = dict(
        MODE=mode,
        HAS_MASK=mask is not None,
        HAS_DONES=dones is not None,
        HAS_CUT=cut is not None,
        BLOCK=block,
        ACC=tl_dtype(acc),
        num_warps=num_warps(block, acc),
    )
    if nb == 1:
        carries = init.reshape(init.shape[0], b, 1)
    else:
        summ = torch.empty((5 if two else 2, b, nb), dtype=acc, device=r.device)
        launch(_estimator_block, (b * nb,), *ptrs, summ, summ, b, t_len, nb, FINAL=False,
               **flags)  # fmt: skip
        carries = block_carries(summ, init)
    launch(_estimator_block, (b * nb,), *ptrs, carries, carries, b, t_len, nb, FINAL=True,
           **flags)  # fmt: skip


def _indicator(t: torch.Tensor | None) -> torch.Tensor | None:
    """A mask or dones as a contiguous bool tensor (read as bytes by the kernels)."""
    return None if t is None else t.bool().contiguous()


def gae_triton(x: GaeInputs, *, block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE in one kernel (with ``values=None``, discounted returns) from a :class:`GaeInputs` of any
    float dtype, the discounts rounded to the carry dtype (float32; float64 for float64 inputs).
    Returns ``(advantages, returns)`` in the inputs' promoted dtype, as
    :func:`rlops.advantages.reference.gae_reference`.
    """
    r, values, mask, dones, cut, end = (
        x.rewards.contiguous(),
        x.values,
        x.mask,
        x.dones,
        x.cut,
        x.end,
    )
    n, t_len = r.shape
    dtypes = (r.dtype,) if values is None else (r.dtype, values.dtype)
    acc = acc_dtype(*dtypes)
    out_dtype = r.dtype if values is None else torch.promote_types(r.dtype, values.dtype)
    gamma, gamma_lam = x.rows()
    g = gamma.reshape(-1).expand(n).to(acc).contiguous()
    ret = torch.empty((n, t_len), dtype=out_dtype, device=r.device)
    cut = None if cut is None or dones is None else cut.contiguous()
    # the carry after the row's end: the return (returns) or the next-action value W (GAE)
    after = torch.zeros(n, dtype=acc, device=r.device) if end is None else end.to(acc)
    if values is None:
        init = after.reshape(1, n).contiguous()
        _run(RETURNS, r, None, _indicator(mask), _indicator(dones), g, None, None, init, None,
             ret, block_t, cut)  # fmt: skip
        return ret, ret
    v = values.contiguous()
    gl = gamma_lam.reshape(-1).expand(n).to(acc).contiguous()
    adv = torch.empty_like(ret)
    init = torch.stack([torch.zeros_like(after), after]).contiguous()
    _run(GAE, r, v, _indicator(mask), _indicator(dones), g, gl, None, init, adv, ret, block_t,
         cut)  # fmt: skip
    return adv, ret


def reinforce_returns_triton(
    kl: torch.Tensor,
    outcome: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: torch.Tensor,
    *,
    block_t: int | None = None,
) -> torch.Tensor:
    """REINFORCE++ returns in one kernel from ``kl`` ``[N, T]``, ``outcome`` ``[N]``, ``mask``
    ``[N, T]`` and ``gamma`` ``[N]``, as :func:`rlops.reinforce_plus_plus_returns` (the token reward
    rounded in ``kl``'s dtype).
    """
    out_dtype = torch.promote_types(kl.dtype, outcome.dtype)
    k = kl.to(out_dtype).contiguous()
    n, t_len = k.shape
    acc = acc_dtype(out_dtype)
    ret = torch.empty((n, t_len), dtype=out_dtype, device=k.device)
    g = gamma.reshape(-1).expand(n).to(acc).contiguous()
    ck = torch.full((1,), -kl_coef, dtype=acc, device=k.device)  # a fill: no host copy
    init = torch.stack([torch.zeros(n, dtype=acc, device=k.device), outcome.to(acc).reshape(n)])
    _run(RPP, k, None, _indicator(mask), None, g, None, ck, init, None, ret, block_t)
    return ret
