"""The op on logits as Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``): the chunk
engine's producer :class:`TritonLogits`, which computes a chunk's statistics and its gradient in
one pass over vocabulary tiles, never materialising the scaled logits.

:func:`shard_stats` streams each fixed slice of a row's vocabulary with an online log-sum-exp
(``s ← s·e^{m−m'} + Σ e^{z−m'}``, the entropy's ``u`` and the float64 ``Σ e``, ``Σ e²``
likewise), folds the slices in order and writes the columns of
:func:`rlops.logprobs._softmax.stats_chunk`; :func:`logits_grad` writes each tile's
``g_lp·(onehot − p_keep) − g_H·p·(log p + H)``, divided by ``τ`` (a float, or the row's
own: one load per row), in the logits' dtype. Slices of a fixed size, vector loads and why a
row's bits do not depend on the batch: ``docs/design/logprobs.md`` and ``docs/gpu.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from rlops._backends import launch
from rlops._triton import acc_dtype, cast_to, tl_dtype
from rlops.logprobs import _engine, _softmax
from rlops.logprobs._plan import Plan

__all__ = ["TritonLogits", "logits_grad", "shard_stats"]


def _config(
    x: torch.Tensor, n: int, v: int, block_n: int | None, block_v: int | None
) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_V, num_warps)``. On a GPU one token per program and 4096-wide tiles
    (16 float32 values per thread at 8 warps). Under the interpreter (the kernels built as
    interpreted functions) a block runs as numpy arrays: 16 tokens per program, 256-wide tiles
    (which still cross tiles at a test's vocabulary). Smaller when the shapes are."""
    if isinstance(_stats_kernel, InterpretedFunction):
        bn = block_n or min(16, triton.next_power_of_2(n))
        bv = block_v or min(256, max(16, triton.next_power_of_2(v)))
    else:
        bn = block_n or 1
        bv = block_v or min(4096, max(16, triton.next_power_of_2(v)))
    return bn, bv, (8 if bv * bn >= 2048 else 4)


def _slice_tiles(x: torch.Tensor) -> int:
    """Tiles per vocabulary slice: 4 (16384 logits) on a GPU, 2 (512) under the interpreter.
    The statistics kernel reduces each slice in a program of its own from fresh accumulators,
    then folds the slices in order; a slice count that depends on the vocabulary alone keeps a
    row's bits independent of ``N``."""
    return 2 if isinstance(_stats_kernel, InterpretedFunction) else 4


def _programs(x: torch.Tensor) -> int:
    """Programs that fill the device: 4 per SM (132 SMs when there is no CUDA device)."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    return 4 * sms


def _splits(x: torch.Tensor, row_blocks: int, units: int) -> tuple[int, int]:
    """``(programs per block of rows, units of work each)`` over ``units`` (the gradient's
    vocabulary tiles): enough programs to fill the device when the rows are few (one per block
    of rows once they are enough). Shapes only; it changes which program does a unit, not its
    maths."""
    want = max(1, min(units, triton.cdiv(_programs(x), row_blocks)))
    per = triton.cdiv(units, want)
    return triton.cdiv(units, per), per


@triton.jit
def _row_tau(tau_ptr, rows, row_ok, TAU_STRIDE: tl.constexpr, ACC: tl.constexpr):
    # the rows' temperatures [BLOCK_N], one load per row: each row's own (TAU_STRIDE 1, a
    # per-row tensor) or the one float's (TAU_STRIDE 0: every row reads element 0; read only
    # when SCALE, else any element: a placeholder)
    return tl.load(tau_ptr + rows * TAU_STRIDE, mask=row_ok, other=1.0).to(ACC)


@triton.jit
def _scaled(x_ptrs, ok, tau, SCALE: tl.constexpr, ACC: tl.constexpr):
    # tau: the rows' temperatures, shaped to broadcast against x_ptrs
    z = tl.load(x_ptrs, mask=ok, other=float("-inf")).to(ACC)
    if SCALE:
        if ACC == tl.float64:
            z = z / tau  # IEEE division in float64
        else:
            z = tl.math.div_rn(z, tau)  # not the approximate float32 division
    return z


@triton.jit
def _online(m, s, u, sw, w, z, ENTROPY: tl.constexpr, SQUARES: tl.constexpr):
    # one tile [BLOCK_N, BLOCK_V] of scaled logits (-inf where absent) into (m, s, u, sw, w)
    # [BLOCK_N]; with SQUARES, sw = Σ exp(z − m) and w = Σ exp(2(z − m)) in float64, both
    # rescaled by the same factor (its rounding cancels in w / sw²)
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_ref)
    # a NaN logit makes the row's sums NaN, as torch's log_softmax does: max.f32 (tl.max) skips
    # NaN, so the clamp that keeps exp(-inf)·(-inf) finite must not drop it too
    d = tl.maximum(z - m_ref[:, None], -1e30, propagate_nan=tl.PropagateNan.ALL)
    e = tl.exp(d)
    if ENTROPY:
        corr = tl.where(m == float("-inf"), 0.0, (m - m_ref) * s)
        u = scale * (u + corr) + tl.sum(e * d, axis=1)
    if SQUARES:
        e64 = e.to(tl.float64)
        sc = scale.to(tl.float64)
        sw = sw * sc + tl.sum(e64, axis=1)
        w = w * (sc * sc) + tl.sum(e64 * e64, axis=1)
    s = s * scale + tl.sum(e, axis=1)
    return m_new, s, u, sw, w


@triton.jit
def _stats_tile(
    x_rows, k_rows, cols, ok, tau, thr, tgt, m, s, u, sw, w, me, se, ue, MASK: tl.constexpr,
    THRESH: tl.constexpr, TWO: tl.constexpr, ENTROPY: tl.constexpr, SQUARES: tl.constexpr,
    SCALE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # one tile of the rows' logits (columns cols, loaded where ok) into the accumulators
    z = _scaled(x_rows + cols[None, :], ok, tau[:, None], SCALE, ACC)
    if MASK or THRESH:
        if MASK:
            keep = tl.load(k_rows + cols[None, :], mask=ok, other=0) != 0
        else:
            keep = z >= thr[:, None]
        keep = keep | (cols[None, :] == tgt[:, None])  # the target is always kept
        z_keep = tl.where(keep, z, float("-inf"))
        if TWO:
            if ENTROPY:
                me, se, ue, _, _ = _online(me, se, ue, sw, w, z, True, False)
            m, s, u, sw, w = _online(m, s, u, sw, w, z_keep, False, SQUARES)
        else:  # over the support: the entropy's distribution is the log-prob's
            m, s, u, sw, w = _online(m, s, u, sw, w, z_keep, ENTROPY, SQUARES)
    else:
        m, s, u, sw, w = _online(m, s, u, sw, w, z, ENTROPY, SQUARES)
    return m, s, u, sw, w, me, se, ue


@triton.jit
def _block_rows(N, valid_ptr, BLOCK_N: tl.constexpr, ROWMASK: tl.constexpr):
    # this program's BLOCK_N rows: their indices, which exist (< N), and which are read (with
    # ROWMASK, only those whose valid_ptr entry is True: the op's row mask)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    row_ok = row_in
    if ROWMASK:
        row_ok = row_in & (tl.load(valid_ptr + rows, mask=row_in, other=0) != 0)
    return rows, row_in, row_ok


@triton.jit
def _stats_kernel(
    x_ptr, tgt_ptr, keep_ptr, thr_ptr, tau_ptr, valid_ptr, out_ptr, part_ptr, N, V, stride_x,
    stride_k, stride_o, offset, N_SLICES, ALIGN_V: tl.constexpr, ALIGN_X: tl.constexpr,
    ALIGN_K: tl.constexpr, ROWMASK: tl.constexpr, MASK: tl.constexpr, THRESH: tl.constexpr,
    TWO: tl.constexpr, ENTROPY: tl.constexpr, SQUARES: tl.constexpr, SQ_COL: tl.constexpr,
    SCALE: tl.constexpr, TAU_STRIDE: tl.constexpr, PARTIAL: tl.constexpr, NP: tl.constexpr,
    SLICE_TILES: tl.constexpr, PEEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    # TWO: the log-prob's distribution (the support) and the entropy's (all logits) differ;
    # SQUARES: ρ = Σ e² / (Σ e)² (e = exp(z − m), sums in float64) of the log-prob's
    # distribution in column SQ_COL, the last; ROWMASK: rows whose valid_ptr entry is False
    # (the op's row mask) read nothing and get the statistics of an empty row (_stats_store).
    # The vocabulary is cut into N_SLICES slices of SLICE_TILES tiles; program (i, j) reduces
    # slice j of its rows from fresh accumulators. PARTIAL (more
    # than one slice): each slice's accumulators go to part_ptr [N, N_SLICES, NP] (float64)
    # and _merge_kernel folds them in slice order; else the one slice's columns go to out_ptr
    rows, row_in, row_ok = _block_rows(N, valid_ptr, BLOCK_N, ROWMASK)
    rows64 = rows.to(tl.int64)
    base = out_ptr + rows64 * stride_o
    if ROWMASK:
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:  # a masked row (GPU: one per program)
            if not PARTIAL:  # (else the merge writes it)
                zero = tl.zeros([BLOCK_N], ACC)
                z64 = zero.to(tl.float64)
                _stats_store(base, row_in, row_ok, zero, zero, zero, zero, zero, zero, zero,
                             z64, z64, ENTROPY, TWO, SQUARES, SQ_COL, ACC)  # fmt: skip
            return
    V = V * ALIGN_V  # V and the strides come in units of ALIGN: rows start 16-byte aligned
    stride_x = stride_x * ALIGN_X  # and a tile's bound is known per vector, so tiles load
    stride_k = stride_k * ALIGN_K  # as vectors
    tau = _row_tau(tau_ptr, rows, row_ok, TAU_STRIDE, ACC)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - offset
    if THRESH:
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    neg = tl.full([BLOCK_N], float("-inf"), ACC)
    zero = tl.zeros([BLOCK_N], ACC)
    cols0 = tl.arange(0, BLOCK_V)
    SLICE: tl.constexpr = SLICE_TILES * BLOCK_V
    k = tl.program_id(1)  # this program's slice
    m, s, u = neg, zero, zero  # the log-prob distribution (kept logits)
    sw = tl.zeros([BLOCK_N], tl.float64)  # its Σ e and Σ e², when SQUARES
    w = tl.zeros([BLOCK_N], tl.float64)
    me, se, ue = neg, zero, zero  # the unmasked distribution (entropy), when TWO
    cols0 = cols0 + k * SLICE  # the slice's first logit
    x_rows = x_ptr + rows64[:, None] * stride_x
    k_rows = keep_ptr + rows64[:, None] * stride_k
    if not THRESH:
        thr = zero  # (unused)
    n_v = tl.minimum(SLICE, V - k * SLICE)
    n_full = 0
    if PEEL:  # rows start aligned, V not a multiple of the vector: the tiles inside V load
        # without a bound along the vocabulary (as vectors), then at most one across it; the
        # same tiles in the same order as without the peel, so the same bits
        n_full = (n_v // BLOCK_V) * BLOCK_V
        for v0 in range(0, n_full, BLOCK_V):
            m, s, u, sw, w, me, se, ue = _stats_tile(
                x_rows, k_rows, v0 + cols0, row_ok[:, None], tau, thr, tgt, m, s, u, sw, w, me,
                se, ue, MASK, THRESH, TWO, ENTROPY, SQUARES, SCALE, ACC,
            )  # fmt: skip
    for v0 in range(n_full, n_v, BLOCK_V):
        cols = v0 + cols0
        m, s, u, sw, w, me, se, ue = _stats_tile(
            x_rows, k_rows, cols, row_ok[:, None] & (cols < V)[None, :], tau, thr, tgt, m, s, u,
            sw, w, me, se, ue, MASK, THRESH, TWO, ENTROPY, SQUARES, SCALE, ACC,
        )  # fmt: skip
    if PARTIAL:
        p = part_ptr + (rows64 * N_SLICES + k) * NP
        tl.store(p, m.to(tl.float64), mask=row_ok)
        tl.store(p + 1, s.to(tl.float64), mask=row_ok)
        tl.store(p + 2, u.to(tl.float64), mask=row_ok)
        if TWO and ENTROPY:
            tl.store(p + 3, me.to(tl.float64), mask=row_ok)
            tl.store(p + 4, se.to(tl.float64), mask=row_ok)
            tl.store(p + 5, ue.to(tl.float64), mask=row_ok)
        if SQUARES:
            tl.store(p + NP - 2, sw, mask=row_ok)
            tl.store(p + NP - 1, w, mask=row_ok)
    else:
        zy = _target_logit(x_ptr, rows64 * stride_x, tgt, row_ok, V, tau, SCALE, ACC)
        _stats_store(base, row_in, row_ok, zy, m, s, u, me, se, ue, sw, w, ENTROPY, TWO,
                     SQUARES, SQ_COL, ACC)  # fmt: skip


@triton.jit
def _target_logit(x_ptr, row_off, tgt, row_ok, V, tau, SCALE: tl.constexpr, ACC: tl.constexpr):
    # z_y, 0 where the target lies outside this shard
    in_range = row_ok & (tgt >= 0) & (tgt < V)
    zy = _scaled(x_ptr + row_off + tgt, in_range, tau, SCALE, ACC)
    return tl.where(in_range, zy, 0.0)


@triton.jit
def _fold(m, s, u, sw, w, mk, sk, uk, swk, wk, ENTROPY: tl.constexpr, SQUARES: tl.constexpr):
    # one slice's accumulators (mk, sk, uk, swk, wk) into the running (m, s, u, sw, w), as a
    # tile goes into them in _online: both rescaled to the larger max (a slice, or the running
    # sums, with max -inf has sums 0 and adds nothing; a NaN in a slice's sums stays)
    m_new = tl.maximum(m, mk)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_ref)
    b = tl.exp(mk - m_ref)
    if ENTROPY:
        ca = tl.where(m == float("-inf"), 0.0, (m - m_ref) * s)
        cb = tl.where(mk == float("-inf"), 0.0, (mk - m_ref) * sk)
        u = a * (u + ca) + b * (uk + cb)
    if SQUARES:
        a64 = a.to(tl.float64)
        b64 = b.to(tl.float64)
        sw = sw * a64 + swk * b64
        w = w * (a64 * a64) + wk * (b64 * b64)
    s = s * a + sk * b
    return m_new, s, u, sw, w


@triton.jit
def _merge_kernel(
    x_ptr, tgt_ptr, tau_ptr, valid_ptr, out_ptr, part_ptr, N, V, stride_x, stride_o, offset,
    N_SLICES, ALIGN_V: tl.constexpr, ALIGN_X: tl.constexpr, ROWMASK: tl.constexpr,
    TWO: tl.constexpr, ENTROPY: tl.constexpr, SQUARES: tl.constexpr, SQ_COL: tl.constexpr,
    SCALE: tl.constexpr, TAU_STRIDE: tl.constexpr, NP: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    # the rows' slices of _stats_kernel (PARTIAL) folded in slice order, whichever program
    # reduced each: a row's statistics do not depend on how the vocabulary was split
    rows, row_in, row_ok = _block_rows(N, valid_ptr, BLOCK_N, ROWMASK)
    rows64 = rows.to(tl.int64)
    tau = _row_tau(tau_ptr, rows, row_ok, TAU_STRIDE, ACC)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - offset
    zy = _target_logit(x_ptr, rows64 * (stride_x * ALIGN_X), tgt, row_ok, V * ALIGN_V, tau,
                       SCALE, ACC)  # fmt: skip
    neg = tl.full([BLOCK_N], float("-inf"), ACC)
    zero = tl.zeros([BLOCK_N], ACC)
    m, s, u, me, se, ue = neg, zero, zero, neg, zero, zero
    sw = tl.zeros([BLOCK_N], tl.float64)
    w = tl.zeros([BLOCK_N], tl.float64)
    for k in range(0, N_SLICES):
        p = part_ptr + (rows64 * N_SLICES + k) * NP
        mk = tl.load(p, mask=row_ok, other=float("-inf")).to(ACC)
        sk = tl.load(p + 1, mask=row_ok, other=0.0).to(ACC)
        uk = tl.load(p + 2, mask=row_ok, other=0.0).to(ACC)
        swk = sw
        wk = w
        if SQUARES:
            swk = tl.load(p + NP - 2, mask=row_ok, other=0.0)
            wk = tl.load(p + NP - 1, mask=row_ok, other=0.0)
        if TWO and ENTROPY:
            mek = tl.load(p + 3, mask=row_ok, other=float("-inf")).to(ACC)
            sek = tl.load(p + 4, mask=row_ok, other=0.0).to(ACC)
            uek = tl.load(p + 5, mask=row_ok, other=0.0).to(ACC)
            me, se, ue, _, _ = _fold(me, se, ue, sw, w, mek, sek, uek, sw, w, True, False)
            m, s, u, sw, w = _fold(m, s, u, sw, w, mk, sk, uk, swk, wk, False, SQUARES)
        else:
            m, s, u, sw, w = _fold(m, s, u, sw, w, mk, sk, uk, swk, wk, ENTROPY, SQUARES)
    _stats_store(out_ptr + rows64 * stride_o, row_in, row_ok, zy, m, s, u, me, se, ue, sw, w,
                 ENTROPY, TWO, SQUARES, SQ_COL, ACC)  # fmt: skip


@triton.jit
def _stats_store(
    base, row_in, row_ok, zy, m, s, u, me, se, ue, sw, w, ENTROPY: tl.constexpr,
    TWO: tl.constexpr, SQUARES: tl.constexpr, SQ_COL: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # a row's columns from its accumulators; a masked row (row_in, not row_ok) gets those of
    # an empty row of log-prob 0: z_y = m = 0, s = 1, h = 0, ρ = 0
    tl.store(base, tl.where(row_ok, zy, 0.0), mask=row_in)
    tl.store(base + 1, tl.where(row_ok, m, 0.0), mask=row_in)
    tl.store(base + 2, tl.where(row_ok, s, 1.0), mask=row_in)
    if ENTROPY:
        if TWO:
            se_ok = tl.where(row_ok, se, 1.0)
            tl.store(base + 3, tl.where(row_ok, me, 0.0), mask=row_in)
            tl.store(base + 4, se_ok, mask=row_in)
            tl.store(base + 5, tl.where(row_ok, tl.log(se_ok) - ue / se_ok, 0.0), mask=row_in)
        else:
            s_ok = tl.where(row_ok, s, 1.0)
            tl.store(base + 3, tl.where(row_ok, tl.log(s_ok) - u / s_ok, 0.0), mask=row_in)
    if SQUARES:
        rho = tl.where(sw > 0, w / tl.where(sw > 0, sw * sw, 1.0), 0.0)
        tl.store(base + SQ_COL, tl.where(row_ok, rho.to(ACC), 0.0), mask=row_in)


@triton.jit
def _grad_kernel(
    x_ptr, tgt_ptr, keep_ptr, thr_ptr, tau_ptr, mp_ptr, lsp_ptr, me_ptr, lse_ptr, h_ptr,
    glp_ptr, gent_ptr, valid_ptr, dx_ptr, N, V, stride_x, stride_k, stride_d, offset, PER,
    ALIGN_V: tl.constexpr, ALIGN_X: tl.constexpr, ALIGN_K: tl.constexpr, ALIGN_D: tl.constexpr,
    ROWMASK: tl.constexpr, MASK: tl.constexpr, THRESH: tl.constexpr, TWO: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, SCALE: tl.constexpr,
    TAU_STRIDE: tl.constexpr, PEEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    rows, row_in, row_ok = _block_rows(N, valid_ptr, BLOCK_N, ROWMASK)
    rows64 = rows.to(tl.int64)
    V = V * ALIGN_V  # V and the strides come in units of ALIGN: rows start 16-byte aligned
    stride_x = stride_x * ALIGN_X  # and a tile's bound is known per vector, so tiles load
    stride_k = stride_k * ALIGN_K  # and store as vectors
    stride_d = stride_d * ALIGN_D
    cols0 = tl.arange(0, BLOCK_V)
    # program (i, j): tiles [j·PER, (j + 1)·PER) of its rows (each element's gradient is
    # independent given its row's statistics: any split gives the same bits)
    v_lo = tl.program_id(1) * (PER * BLOCK_V)
    v_hi = tl.minimum(v_lo + PER * BLOCK_V, V)
    if ROWMASK:  # rows whose valid_ptr entry is False: a zero gradient, nothing read
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:  # a masked row (GPU: one per program)
            zeros = tl.zeros([BLOCK_N, BLOCK_V], dx_ptr.dtype.element_ty)
            for v0 in range(v_lo, v_hi, BLOCK_V):
                cols = v0 + cols0
                tl.store(dx_ptr + rows64[:, None] * stride_d + cols[None, :], zeros,
                         mask=row_in[:, None] & (cols < V)[None, :])  # fmt: skip
            return
    tau = _row_tau(tau_ptr, rows, row_ok, TAU_STRIDE, ACC)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - offset
    # (M, log S) of the log-prob distribution; (M, log S, H) of the entropy's
    mp = tl.load(mp_ptr + rows, mask=row_ok, other=0.0)
    lsp = tl.load(lsp_ptr + rows, mask=row_ok, other=0.0)
    if HAS_ENT:
        me = tl.load(me_ptr + rows, mask=row_ok, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        h = tl.load(h_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    if HAS_LP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    if THRESH:
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0).to(ACC)
    else:
        thr = mp  # (unused)
    if not HAS_ENT:
        me, lse, h, gent = mp, mp, mp, mp  # (unused)
    if not HAS_LP:
        glp = mp  # (unused)
    x_rows = x_ptr + rows64[:, None] * stride_x
    k_rows = keep_ptr + rows64[:, None] * stride_k
    d_rows = dx_ptr + rows64[:, None] * stride_d
    v_full = v_lo
    if PEEL:  # the tiles inside V without a bound along the vocabulary (as vectors), then at
        # most one across it (as in _stats_kernel)
        v_full = tl.minimum(v_hi, v_lo + ((V - v_lo) // BLOCK_V) * BLOCK_V)
        for v0 in range(v_lo, v_full, BLOCK_V):
            _grad_tile(x_rows, k_rows, d_rows, v0 + cols0, row_ok[:, None], row_in[:, None],
                       tau, thr, tgt, mp, lsp, me, lse, h, glp, gent, MASK, THRESH, TWO, HAS_LP,
                       HAS_ENT, SCALE, ROWMASK, ACC)  # fmt: skip
    for v0 in range(v_full, v_hi, BLOCK_V):
        cols = v0 + cols0
        inside = (cols < V)[None, :]
        _grad_tile(x_rows, k_rows, d_rows, cols, row_ok[:, None] & inside,
                   row_in[:, None] & inside, tau, thr, tgt, mp, lsp, me, lse, h, glp, gent, MASK,
                   THRESH, TWO, HAS_LP, HAS_ENT, SCALE, ROWMASK, ACC)  # fmt: skip


@triton.jit
def _grad_tile(
    x_rows, k_rows, d_rows, cols, ok, st, tau, thr, tgt, mp, lsp, me, lse, h, glp, gent,
    MASK: tl.constexpr, THRESH: tl.constexpr, TWO: tl.constexpr, HAS_LP: tl.constexpr,
    HAS_ENT: tl.constexpr, SCALE: tl.constexpr, ROWMASK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # one tile of the gradient: read where ok, written where st (ROWMASK: zeros where st and
    # not ok, a masked row beside valid ones in a block of several rows)
    z = _scaled(x_rows + cols[None, :], ok, tau[:, None], SCALE, ACC)
    onehot = cols[None, :] == tgt[:, None]
    if MASK or THRESH:
        if MASK:
            keep = tl.load(k_rows + cols[None, :], mask=ok, other=0) != 0
        else:
            keep = z >= thr[:, None]
        keep = keep | onehot
        if not TWO:  # over the support: probability 0 outside it
            z = tl.where(keep, z, float("-inf"))
    grad = tl.zeros(z.shape, ACC)
    if HAS_ENT:
        log_p = z - me[:, None] - lse[:, None]
        p = tl.exp(log_p)
        grad -= gent[:, None] * p * (tl.maximum(log_p, -1e30) + h[:, None])
    if HAS_LP:
        p_keep = tl.exp(z - mp[:, None] - lsp[:, None])
        if TWO:
            p_keep = tl.where(keep, p_keep, 0.0)
        grad += glp[:, None] * (tl.where(onehot, 1.0, 0.0) - p_keep)
    if SCALE:
        grad = grad * (1.0 / tau)[:, None]
    if ROWMASK:
        grad = tl.where(ok, grad, 0.0)
        ok = st
    grad = cast_to(grad, d_rows.dtype.element_ty)
    tl.store(d_rows + cols[None, :], grad, mask=ok)


def _align(t: torch.Tensor | None) -> int:
    """How many elements of ``t``'s rows (at most 16 bytes' worth) its row stride is a
    multiple of: the kernels get the stride in these units and multiply it back by a constant,
    so they know every row starts 16-byte aligned (with a 16-byte aligned base) and load and
    store vectors, which triton infers by itself only for strides divisible by 16 (V = 50280
    in bfloat16 is divisible by 8, not 16). 1 when it is not (V = 50257)."""
    if t is None or t.dim() < 2:
        return 1
    per = max(1, 16 // t.element_size())
    while per > 1 and (t.stride(0) % per or t.data_ptr() % 16):
        per //= 2
    return per


def _align_v(v: int) -> int:
    """The largest power of two up to 16 that divides the vocabulary ``v``."""
    return min(16, v & -v) if v else 1


def _peel(v: int, x: torch.Tensor, keep: torch.Tensor | None) -> bool:
    """Whether the kernels peel a row's last, partial tile: when the rows start better aligned
    than the vocabulary's length is a multiple of (V = 50257 as a view of rows padded to 50304,
    a padded output layer's logits): the tiles inside V then load as vectors. Not when the
    rows themselves start misaligned (V = 50257 contiguous: see docs/gpu.md)."""
    return min(_align(x), _align(keep) if keep is not None else 16) > _align_v(v)


def _strides(*ts: torch.Tensor | None) -> list[int]:
    """Row strides in units of :func:`_align` (0 for an absent tensor)."""
    return [0 if t is None else t.stride(0) // _align(t) for t in ts]


def _rows_view(t: torch.Tensor, v: int) -> torch.Tensor:
    """``t`` as ``[N, v]`` rows with a unit stride along the vocabulary (a copy if need be)."""
    x = t.reshape(-1, v)
    return x if x.stride(-1) == 1 or v == 1 else x.contiguous()


def _column(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A per-token ``[N]`` or ``[N, 1]`` tensor as a contiguous ``[N]`` in ``dtype``."""
    return None if t is None else t.reshape(n).to(dtype).contiguous()


def _valid(row_valid: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The row mask as a contiguous ``[N]`` bool (None: every row valid)."""
    if row_valid is None:
        return None
    if row_valid.dtype != torch.bool or row_valid.numel() != n:
        got = f"{list(row_valid.shape)} {row_valid.dtype}"
        raise ValueError(f"row_valid must be [{n}] bool, got {got}")
    return row_valid.reshape(n).contiguous()


def _support_args(
    x: torch.Tensor, keep_mask: torch.Tensor | None, threshold: torch.Tensor | None, acc
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    n, v = x.shape
    if keep_mask is not None and threshold is not None:
        raise ValueError("give the support either as keep_mask or as threshold, not both")
    keep = None if keep_mask is None else _rows_view(keep_mask, v)
    return keep, _column(threshold, n, acc)


def _tau(
    temperature: float | torch.Tensor, n: int, acc: torch.dtype, like: torch.Tensor
) -> tuple[torch.Tensor, int, bool]:
    """``(tau, TAU_STRIDE, SCALE)``: a per-row temperature (``[N]`` or ``[N, 1]``) as a
    contiguous ``[N]`` in ``acc`` read at stride 1; a float as a one-element device tensor (a
    fill: no host-to-device copy, and one compiled kernel for every temperature) read at
    stride 0, or ``like`` as a placeholder when the logits are not scaled."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != n or not temperature.is_floating_point():
            got = f"{list(temperature.shape)} {temperature.dtype}"
            raise ValueError(f"temperature must be a float or a floating [{n}] tensor, got {got}")
        return temperature.reshape(n).to(acc).contiguous(), 1, True
    if temperature == 1.0:
        return like, 0, False
    return torch.full((1,), temperature, dtype=acc, device=like.device), 0, True


def shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    offset: int = 0,
    temperature: float | torch.Tensor = 1.0,
    keep_mask: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    over_support: bool = False,
    with_entropy: bool = True,
    with_squares: bool = False,
    row_valid: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_v: int | None = None,
    slice_tiles: int | None = None,
) -> torch.Tensor:
    """This shard's statistics ``[N, k]``, the columns of
    :func:`~rlops.logprobs._softmax.stats_chunk`.

    ``logits`` ``[N, V_local]`` (any float dtype), ``target`` ``[N]`` global ids, ``offset``
    this shard's first id, ``temperature`` a float or one per row (``[N]``). ``keep_mask``
    ``[N, V_local]`` bool, or ``threshold`` ``[N]`` (the sampler's support ``z ≥ t`` on the
    scaled logits, as :func:`rlops.logprobs._support.threshold_chunk` gives it): the log-prob
    is then over the
    kept logits (the target always kept), the entropy over all of them — or over the support
    too with ``over_support`` (then only ``k = 3 + 1`` columns, as without a support).
    ``with_squares``: one more column, last, ``ρ = Σ p²`` of the log-prob distribution within
    the shard (:func:`rlops.logprobs._softmax.merge_squares` merges it). ``row_valid`` ``[N]``
    bool (the op's row mask): the programs of rows where it is False read nothing and write
    the statistics of an empty row (``z_y = m = 0``, ``s = 1``, ``h = 0``, ``ρ = 0``).
    Written into ``out`` when given (``[N, k]`` rows of a unit column stride, in the compute
    dtype); float32 statistics (float64 for float64 logits). ``block_n``, ``block_v``,
    ``slice_tiles`` (tiles per vocabulary slice): the kernel's blocks, by default
    :func:`_config`'s and :func:`_slice_tiles`'s; the bits depend on them, not on ``N``."""
    v = logits.shape[-1]
    x = _rows_view(logits, v)
    n = x.shape[0]
    acc = acc_dtype(x.dtype)
    keep, thr = _support_args(x, keep_mask, threshold, acc)
    supported = keep is not None or thr is not None
    two = supported and not over_support
    ncol = _softmax.n_columns(two, with_entropy, with_squares)
    if out is None:
        out = torch.empty((n, ncol), dtype=acc, device=x.device)
    if tuple(out.shape) != (n, ncol) or out.dtype != acc or (ncol > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [{n}, {ncol}] {acc} with unit column stride, got "
            f"{list(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if n == 0:
        return out
    tgt = target.reshape(n).to(torch.int64).contiguous()
    tau, tau_stride, scale = _tau(temperature, n, acc, x)
    valid = _valid(row_valid, n)
    bn, bv, warps = _config(x, n, v, block_n, block_v)
    tiles = slice_tiles or _slice_tiles(x)
    n_slices = triton.cdiv(v, tiles * bv)
    partial = n_slices > 1
    n_part = 3 + 3 * (two and with_entropy) + 2 * with_squares
    # the slices' accumulators: [N, slices, n_part] float64, a few numbers per 16384 logits
    part = torch.empty((n, n_slices, n_part) if partial else (1,), dtype=torch.float64,
                       device=x.device)  # fmt: skip
    flags = dict(
        ROWMASK=valid is not None, TWO=two, ENTROPY=with_entropy, SQUARES=with_squares,
        SQ_COL=ncol - 1, SCALE=scale, TAU_STRIDE=tau_stride, NP=n_part, ACC=tl_dtype(acc),
    )  # fmt: skip
    launch(
        _stats_kernel, (triton.cdiv(n, bn), n_slices),
        x, tgt, x if keep is None else keep, tau if thr is None else thr, tau,
        tgt if valid is None else valid, out, part,
        n, v // _align_v(v), *_strides(x, keep), out.stride(0), offset, n_slices,
        ALIGN_V=_align_v(v), ALIGN_X=_align(x), ALIGN_K=_align(keep), MASK=keep is not None,
        THRESH=thr is not None, PARTIAL=partial, SLICE_TILES=tiles, PEEL=_peel(v, x, keep),
        BLOCK_N=bn, BLOCK_V=bv,
        num_warps=warps, **flags,
    )  # fmt: skip
    if partial:
        bm = min(128, triton.next_power_of_2(n))
        launch(
            _merge_kernel, (triton.cdiv(n, bm),),
            x, tgt, tau, tgt if valid is None else valid, out, part,
            n, v // _align_v(v), _strides(x)[0], out.stride(0), offset, n_slices,
            ALIGN_V=_align_v(v), ALIGN_X=_align(x), BLOCK_N=bm, num_warps=4, **flags,
        )  # fmt: skip
    return out


def logits_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    saved: Sequence[torch.Tensor],
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    *,
    offset: int = 0,
    temperature: float | torch.Tensor = 1.0,
    keep_mask: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    over_support: bool = False,
    row_valid: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. this shard's logits ``[N, V_local]``, in their dtype (or ``out``'s).

    ``saved``: ``(M, log S)`` of the log-prob distribution, then (needed with ``g_ent``)
    ``(M, log S, H)`` of the entropy's — the merged statistics
    (:func:`rlops.logprobs._softmax.merge`), each ``[N]`` or ``[N, 1]`` (a ``[5, N]`` tensor
    works too). ``g_logp``, ``g_ent``: ``[N]`` upstream gradients or None (at least one
    given). ``row_valid`` ``[N]`` bool (the op's row mask): rows where it is False get a zero
    gradient, written without reading anything of theirs. ``temperature``: as in
    :func:`shard_stats`. ``out``: ``[N, V_local]`` rows of a
    unit column stride, any float dtype (the gradient is computed in float32, or float64, and
    rounded to it)."""
    v = logits.shape[-1]
    x = _rows_view(logits, v)
    n = x.shape[0]
    acc = acc_dtype(x.dtype)
    keep, thr = _support_args(x, keep_mask, threshold, acc)
    two = (keep is not None or thr is not None) and not over_support
    if out is None:
        out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (n, v) or (v > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{n}, {v}] with unit column stride, got {list(out.shape)}")
    if g_logp is None and g_ent is None:
        raise ValueError("logits_grad needs g_logp or g_ent")
    cols = [_column(t, n, acc) for t in saved]
    if len(cols) < (5 if g_ent is not None else 2):
        raise ValueError(f"saved needs 5 columns with g_ent (2 without), got {len(cols)}")
    if n == 0:
        return out
    tgt = target.reshape(n).to(torch.int64).contiguous()
    tau, tau_stride, scale = _tau(temperature, n, acc, x)
    glp, gent = _column(g_logp, n, acc), _column(g_ent, n, acc)
    mp, lsp, *rest = cols
    me, lse, h = rest if g_ent is not None else (mp, mp, mp)
    valid = _valid(row_valid, n)
    bn, bv, warps = _config(x, n, v, block_n, block_v)
    splits, per = _splits(x, triton.cdiv(n, bn), triton.cdiv(v, bv))
    launch(
        _grad_kernel, (triton.cdiv(n, bn), splits),
        x, tgt, x if keep is None else keep, tau if thr is None else thr, tau,
        mp, lsp, me, lse, h, mp if glp is None else glp, mp if gent is None else gent,
        tgt if valid is None else valid, out,
        n, v // _align_v(v), *_strides(x, keep, out), offset, per,
        ALIGN_V=_align_v(v), ALIGN_X=_align(x), ALIGN_K=_align(keep), ALIGN_D=_align(out),
        ROWMASK=valid is not None, MASK=keep is not None, THRESH=thr is not None, TWO=two,
        HAS_LP=glp is not None, HAS_ENT=gent is not None, SCALE=scale, TAU_STRIDE=tau_stride,
        PEEL=_peel(v, x, keep), BLOCK_N=bn, BLOCK_V=bv, ACC=tl_dtype(acc), num_warps=warps,
    )  # fmt: skip
    return out


class TritonLogits(_engine.Producer):
    """The engine's producer on logits ``[N, V_local]`` with the Triton kernels: :meth:`stats`
    and :meth:`grad` launch :func:`shard_stats` and :func:`logits_grad` on a chunk of rows;
    :meth:`logits` (the sampler's threshold) and the fallback after a build failure are
    ``torch_producer``'s. One chunk at a time: a launch covers all of its rows."""

    parallel = False
    zeroes_masked_rows = True
    threshold_given = True

    def __init__(self, x: torch.Tensor, plan: Plan, torch_producer: _engine.Producer) -> None:
        self.x, self.fallback = _rows_view(x, plan.v_local), torch_producer
        self.logits = torch_producer.logits  # type: ignore[method-assign]

    def stats(
        self, plan: Plan, i: int, j: int, keep: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        assert plan.target is not None
        thr = None
        if plan.sampler is not None and plan.threshold is not None:
            thr = plan.threshold[i:j]  # found by the engine in one process
        shard_stats(
            self.x[i:j], plan.target[i:j], offset=plan.start, temperature=_tau_rows(plan, i, j),
            keep_mask=keep, threshold=thr, over_support=plan.over_support,
            with_entropy=plan.with_entropy, with_squares=plan.sum_pi_squared,
            row_valid=_rows(plan.row_valid, i, j), out=out,
        )  # fmt: skip

    def grad(
        self, plan: Plan, i: int, j: int, keep: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        assert plan.target is not None
        return logits_grad(
            self.x[i:j], plan.target[i:j], [t[i:j] for t in plan.saved],
            None if plan.g_logp is None else plan.g_logp[i:j],
            None if plan.g_ent is None else plan.g_ent[i:j],
            offset=plan.start, temperature=_tau_rows(plan, i, j), keep_mask=keep,
            threshold=None if plan.threshold is None else plan.threshold[i:j],
            over_support=plan.over_support, row_valid=_rows(plan.row_valid, i, j), out=out,
        )  # fmt: skip


def _rows(t: torch.Tensor | None, i: int, j: int) -> torch.Tensor | None:
    return None if t is None else t[i:j]


def _tau_rows(plan: Plan, i: int, j: int) -> float | torch.Tensor:
    """The temperature of rows ``i:j``: a float, or their slice of the per-row ``[N, 1]``."""
    return plan.head.rows(i, j).temperature
