"""Log-prob and entropy statistics of a vocabulary shard as Triton kernels (CUDA; CPU tensors
under ``TRITON_INTERPRET=1``).

Forward (:func:`shard_stats`): one program per block of tokens streams the shard's logits in
vocabulary tiles with an online log-sum-exp and writes, per token, the columns that
:mod:`rlops.logprobs._shard` defines — the target logit ``z_y`` (0 when the target lies outside
``[offset, offset + V_local)``), the max ``m`` and ``s = Σ exp(z − m)`` of the log-prob
distribution, and the shard's own entropy ``h = log s − Σ exp(z − m)(z − m)/s`` (with a keep
mask or a sampler threshold, ``(m, s, h)`` of the unmasked logits in three more columns). When
a tile raises the max from ``m`` to ``m'`` the running sums are rescaled,
``s ← s·e^{m−m'} + Σ e^{z−m'}`` and ``u ← e^{m−m'}·(u + (m − m')·s) + Σ e^{z−m'}(z − m')``,
every term ``≤ 0`` in ``u``: nothing cancels. ``z = logits / temperature`` in float32 (float64
for float64 logits), divided with IEEE rounding as the torch path does.

The shards' statistics are merged in torch (:func:`rlops.logprobs._shard.merge`; under tensor
parallelism after the one all-gather, which stays with the caller).

Backward (:func:`logits_grad`): from the saved merged statistics ``(M, log S)`` of the
log-prob distribution and ``(M, log S, H)`` of the unmasked one, every tile of the gradient
is local: ``dz = g_lp·(onehot − p_keep) − g_H·p·(log p + H)``, divided by the temperature,
written in the logits' dtype tile by tile (nothing ``[N, V]`` but the gradient itself).

:func:`logprobs_and_entropy_triton` puts the two together for one process, as an autograd
function (first derivatives; the fused torch path keeps double backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlops.logprobs import _shard
from rlops.scan.triton import cast_to

__all__ = ["logits_grad", "logprobs_and_entropy_triton", "shard_stats"]

_FLOOR = -1e30  # as _shard: exp(-1e30) is 0, and a -inf logit contributes 0 * finite


def _config(n: int, v: int, block_n: int | None, block_v: int | None) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_V, num_warps)``: on a GPU one token per program and 4096-wide tiles
    (16 float32 values per thread at 8 warps); smaller when the shapes are."""
    bv = block_v or min(4096, max(16, triton.next_power_of_2(v)))
    bn = block_n or 1
    return bn, bv, (8 if bv * bn >= 2048 else 4)


@triton.jit
def _scaled(x_ptrs, ok, tau, SCALE: tl.constexpr, ACC: tl.constexpr):
    z = tl.load(x_ptrs, mask=ok, other=float("-inf")).to(ACC)
    if SCALE:
        if ACC == tl.float64:
            z = z / tau  # IEEE division in float64
        else:
            z = tl.math.div_rn(z, tau)  # not the approximate float32 division
    return z


@triton.jit
def _online(m, s, u, z, ENTROPY: tl.constexpr):
    # one tile [BLOCK_N, BLOCK_V] of scaled logits (-inf where absent) into (m, s, u) [BLOCK_N]
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_ref)
    d = tl.maximum(z - m_ref[:, None], -1e30)
    e = tl.exp(d)
    if ENTROPY:
        corr = tl.where(m == float("-inf"), 0.0, (m - m_ref) * s)
        u = scale * (u + corr) + tl.sum(e * d, axis=1)
    s = s * scale + tl.sum(e, axis=1)
    return m_new, s, u


@triton.jit
def _stats_kernel(
    x_ptr, tgt_ptr, keep_ptr, thr_ptr, tau_ptr, out_ptr, N, V, stride_x, stride_k, offset,
    MASK: tl.constexpr, THRESH: tl.constexpr, ENTROPY: tl.constexpr, SCALE: tl.constexpr,
    NCOL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    tau = tl.load(tau_ptr).to(ACC)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - offset
    in_range = row_ok & (tgt >= 0) & (tgt < V)
    zy = _scaled(x_ptr + rows64 * stride_x + tgt, in_range, tau, SCALE, ACC)
    zy = tl.where(in_range, zy, 0.0)
    if THRESH:
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    neg = tl.full([BLOCK_N], float("-inf"), ACC)
    zero = tl.zeros([BLOCK_N], ACC)
    m, s, u = neg, zero, zero  # the log-prob distribution (kept logits)
    me, se, ue = neg, zero, zero  # the unmasked distribution (entropy), with a mask
    cols0 = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        ok = row_ok[:, None] & (cols < V)[None, :]
        z = _scaled(x_ptr + rows64[:, None] * stride_x + cols[None, :], ok, tau, SCALE, ACC)
        if MASK or THRESH:
            if ENTROPY:
                me, se, ue = _online(me, se, ue, z, True)
            if MASK:
                keep = tl.load(keep_ptr + rows64[:, None] * stride_k + cols[None, :], mask=ok,
                               other=0) != 0  # fmt: skip
            else:
                keep = z >= thr[:, None]
            keep = keep | (cols[None, :] == tgt[:, None])  # the target is always kept
            z = tl.where(keep, z, float("-inf"))
            m, s, u = _online(m, s, u, z, False)
        else:
            m, s, u = _online(m, s, u, z, ENTROPY)
    base = out_ptr + rows64 * NCOL
    tl.store(base, zy, mask=row_ok)
    tl.store(base + 1, m, mask=row_ok)
    tl.store(base + 2, s, mask=row_ok)
    if ENTROPY:
        if MASK or THRESH:
            tl.store(base + 3, me, mask=row_ok)
            tl.store(base + 4, se, mask=row_ok)
            tl.store(base + 5, tl.log(se) - ue / se, mask=row_ok)
        else:
            tl.store(base + 3, tl.log(s) - u / s, mask=row_ok)


@triton.jit
def _grad_kernel(
    x_ptr, tgt_ptr, keep_ptr, thr_ptr, tau_ptr, saved_ptr, glp_ptr, gent_ptr, dx_ptr,
    N, V, stride_x, stride_k, offset,
    MASK: tl.constexpr, THRESH: tl.constexpr, HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr,
    SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    tau = tl.load(tau_ptr).to(ACC)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - offset
    # saved [5, N]: (M, log S) of the log-prob distribution, (M, log S, H) of the unmasked one
    mp = tl.load(saved_ptr + rows, mask=row_ok, other=0.0)
    lsp = tl.load(saved_ptr + N + rows, mask=row_ok, other=0.0)
    me = tl.load(saved_ptr + 2 * N + rows, mask=row_ok, other=0.0)
    lse = tl.load(saved_ptr + 3 * N + rows, mask=row_ok, other=0.0)
    h = tl.load(saved_ptr + 4 * N + rows, mask=row_ok, other=0.0)
    inv = 1.0 / tau
    glp = tl.zeros([BLOCK_N], ACC)
    gent = tl.zeros([BLOCK_N], ACC)
    if HAS_LP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    if HAS_ENT:
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    if THRESH:
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    cols0 = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        ok = row_ok[:, None] & (cols < V)[None, :]
        z = _scaled(x_ptr + rows64[:, None] * stride_x + cols[None, :], ok, tau, SCALE, ACC)
        onehot = cols[None, :] == tgt[:, None]
        grad = tl.zeros([BLOCK_N, BLOCK_V], ACC)
        if HAS_ENT:
            log_p = z - me[:, None] - lse[:, None]
            p = tl.exp(log_p)
            grad -= gent[:, None] * p * (tl.maximum(log_p, -1e30) + h[:, None])
        if HAS_LP:
            p_keep = tl.exp(z - mp[:, None] - lsp[:, None])
            if MASK or THRESH:
                if MASK:
                    keep = tl.load(keep_ptr + rows64[:, None] * stride_k + cols[None, :],
                                   mask=ok, other=0) != 0  # fmt: skip
                else:
                    keep = z >= thr[:, None]
                p_keep = tl.where(keep | onehot, p_keep, 0.0)
            grad += glp[:, None] * (tl.where(onehot, 1.0, 0.0) - p_keep)
        grad = cast_to(grad * inv, dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + rows64[:, None] * V + cols[None, :], grad, mask=ok)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows_view(logits: torch.Tensor) -> torch.Tensor:
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    offset: int = 0,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    with_entropy: bool = True,
    block_n: int | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """This shard's statistics ``[N, k]`` (columns of :mod:`rlops.logprobs._shard`).

    ``logits`` ``[N, V_local]`` (any float dtype; rows with a unit stride along the vocabulary),
    ``target`` ``[N]`` global ids, ``offset`` this shard's first id. ``keep_mask``
    ``[N, V_local]`` bool, or ``threshold`` ``[N]`` (the sampler's support ``z ≥ t`` on the
    scaled logits, as :func:`rlops.logprobs._support.threshold_chunk` gives it): the log-prob
    is then over the kept logits (the target always kept), the entropy over all of them.
    Returns float32 statistics (float64 for float64 logits)."""
    x = _rows_view(logits)
    n, v = x.shape
    acc = _acc(x.dtype)
    masked = keep_mask is not None or threshold is not None
    ncol = _shard.n_columns(masked, with_entropy)
    out = torch.empty((n, ncol), dtype=acc, device=x.device)
    if n == 0:
        return out
    tgt = target.reshape(-1).to(torch.int64).contiguous()
    keep = None if keep_mask is None else keep_mask.reshape(n, v).contiguous()
    thr = None if threshold is None else threshold.reshape(n).to(acc).contiguous()
    tau = torch.tensor([temperature], dtype=acc, device=x.device)
    bn, bv, warps = _config(n, v, block_n, block_v)
    _stats_kernel[(triton.cdiv(n, bn),)](
        x, tgt, x if keep is None else keep, tau if thr is None else thr, tau, out,
        n, v, x.stride(0), 0 if keep is None else keep.stride(0), offset,
        MASK=keep is not None, THRESH=thr is not None, ENTROPY=with_entropy,
        SCALE=temperature != 1.0, NCOL=ncol, BLOCK_N=bn, BLOCK_V=bv, ACC=_tl(acc),
        num_warps=warps,
    )  # fmt: skip
    return out


def logits_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    saved: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    *,
    offset: int = 0,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    block_n: int | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. this shard's logits ``[N, V_local]``, in their dtype.

    ``saved`` ``[5, N]``: ``(M, log S)`` of the log-prob distribution and ``(M, log S, H)`` of
    the unmasked one (the merged statistics; without a mask the two pairs are equal).
    ``g_logp``, ``g_ent``: ``[N]`` upstream gradients or None (the entropy's None when it has
    no gradient)."""
    x = _rows_view(logits)
    n, v = x.shape
    acc = _acc(x.dtype)
    dx = torch.empty((n, v), dtype=x.dtype, device=x.device)
    if n == 0:
        return dx
    tgt = target.reshape(-1).to(torch.int64).contiguous()
    keep = None if keep_mask is None else keep_mask.reshape(n, v).contiguous()
    thr = None if threshold is None else threshold.reshape(n).to(acc).contiguous()
    tau = torch.tensor([temperature], dtype=acc, device=x.device)
    saved = saved.to(acc).contiguous()
    glp = None if g_logp is None else g_logp.reshape(n).to(acc).contiguous()
    gent = None if g_ent is None else g_ent.reshape(n).to(acc).contiguous()
    bn, bv, warps = _config(n, v, block_n, block_v)
    _grad_kernel[(triton.cdiv(n, bn),)](
        x, tgt, x if keep is None else keep, tau if thr is None else thr, tau, saved,
        tau if glp is None else glp, tau if gent is None else gent, dx,
        n, v, x.stride(0), 0 if keep is None else keep.stride(0), offset,
        MASK=keep is not None, THRESH=thr is not None, HAS_LP=glp is not None,
        HAS_ENT=gent is not None, SCALE=temperature != 1.0, BLOCK_N=bn, BLOCK_V=bv,
        ACC=_tl(acc), num_warps=warps,
    )  # fmt: skip
    return dx


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, keep, threshold, temperature, with_entropy, entropy_grad,
                blocks):  # fmt: skip
        kw = dict(temperature=temperature, keep_mask=keep, threshold=threshold)
        stats = shard_stats(logits, target, with_entropy=with_entropy, **kw, **blocks)
        masked = keep is not None or threshold is not None
        logp, ent, saved = _shard.merge(stats.unsqueeze(0), masked, with_entropy)
        if ent is None:
            saved5 = torch.stack([*saved, *saved, torch.zeros_like(saved[0])])
        elif masked:
            saved5 = torch.stack(saved)
        else:
            saved5 = torch.stack([saved[0], saved[1], saved[0], saved[1], saved[4]])
        ctx.kw, ctx.blocks = kw, blocks
        ctx.has_ent = ent is not None and entropy_grad
        ctx.save_for_backward(logits, target, saved5)
        lead = logits.shape[:-1]
        ent_out = logp.new_empty(0) if ent is None else ent.view(lead)
        if not ctx.has_ent:
            ctx.mark_non_differentiable(ent_out)
        ctx.set_materialize_grads(False)
        return logp.view(lead), ent_out

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, target, saved5 = ctx.saved_tensors
        g_ent = g_ent if ctx.has_ent else None
        if g_logp is None and g_ent is None:
            return (None,) * 8
        grad = logits_grad(logits, target, saved5, g_logp, g_ent, **ctx.kw, **ctx.blocks)
        return (grad.view(logits.shape), *(None,) * 7)


def logprobs_and_entropy_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    block_n: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy of ``logits`` ``[..., V]`` in one process, with the Triton kernels.

    ``logp = z_y − lse(z_keep)``, ``H = lse(z) − Σ softmax(z)·z`` with ``z = logits / τ``; a
    ``keep_mask`` ``[..., V]`` or a ``threshold`` ``[...]`` (support ``z ≥ t``, the target
    always kept) restricts the log-prob's distribution, not the entropy's. Returns ``(logp,
    entropy or None)``, float32 (float64 for float64 logits), differentiable w.r.t. ``logits``
    (the entropy only with ``entropy_grad``). The semantics of
    :func:`rlops.logprobs.reference.logprobs_and_entropy_reference`; arguments unchecked (the
    public function checks them)."""
    blocks = dict(block_n=block_n, block_v=block_v)
    logp, ent = _TritonLogprobs.apply(
        logits, target, keep_mask, threshold, temperature, with_entropy, entropy_grad, blocks
    )
    return logp, (ent if with_entropy else None)
