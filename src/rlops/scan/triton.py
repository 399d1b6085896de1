"""The discounted reverse scan as Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

    y[t] = x[t] + a[t] * y[t+1],        y[T] = y_boot (default 0)

Each step is the affine map ``f_t(y) = x[t] + a[t]·y``, and maps compose associatively, so a
two-level scan fills the device with one long row: every ``(row, block)`` program reduces its
block to one map (``tl.associative_scan``), one program per row scans the block maps into
carries, and every block is scanned again with its carry. :func:`compose2` is the same for a
two-number state (GAE, REINFORCE++ returns: :mod:`rlops.advantages.triton`). The block, the
carry tile and the warps are constants, so a row's bits do not depend on the batch; a zero
decay is an exact cut; :class:`ReverseScan`'s backward is the adjoint scan forward in time
(docs/design/scan.md). Not exported: the dispatch decides when these run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlops._backends import KernelBuildError, failed, launch, set_failed, warp_size
from rlops._triton import acc_dtype, cast_to, tl_dtype

__all__ = [
    "BLOCK_T",
    "ReverseScan",
    "acc_dtype",
    "block_carries",
    "block_cell",
    "block_head",
    "block_size",
    "cast_to",
    "compose1",
    "compose2",
    "num_warps",
    "plane_size",
    "reverse_scan",
]

# Time steps per block. A constant, never chosen from the shape: a block size that followed the
# number of rows (as one did: 256 steps at B = 1, 1024 at B = 256) moved a row's block
# boundaries, so its bits, with the batch. 256 keeps one long row's device full (512 programs
# at T = 131072); docs/gpu.md weighs it against larger blocks at large B.
BLOCK_T = 256
# Block maps per tile of the carry pass, counted from block 0 (a constant for the same reason).
_CARRY_BLOCK = 256


@triton.jit
def compose1(p2, c2, p1, c1):
    """``(p1, c1) ∘ (p2, c2)``: step 1 (earlier) after step 2 (later, accumulated)."""
    return p1 * p2, c1 + p1 * tl.where(p1 == 0, 0.0, c2)


@triton.jit
def compose2(p2, q2, s2, c2, e2, p1, q1, s1, c1, e1):
    """Two-number state ``(A, W) ↦ (c + p·A + q·W, e + s·W)``: map 1 (earlier) after map 2."""
    p = p1 * p2
    q = p1 * q2 + q1 * s2
    s = s1 * s2
    c = c1 + p1 * tl.where(p1 == 0, 0.0, c2) + q1 * tl.where(q1 == 0, 0.0, e2)
    e = e1 + s1 * tl.where(s1 == 0, 0.0, e2)
    return p, q, s, c, e


@triton.jit
def block_head(v, i):
    # the value at the block's earliest time (lane 0 of a reverse scan): exact, NaN-safe
    return tl.sum(tl.where(i == 0, v, 0.0), axis=0)


@triton.jit
def block_cell(T, NB, BLOCK: tl.constexpr):
    """This ``(row, block)`` program's place in the flat grid of ``B·NB`` programs:
    ``(cell, row, i, t, ok, base)`` with ``i`` the lanes ``0..BLOCK-1``, ``t`` their time
    indices (contiguous: vector loads; the scan runs from the block's end), ``ok`` those inside
    ``T`` and ``base`` the row's offset in a ``[B, T]`` tensor (all int64)."""
    cell = tl.program_id(0).to(tl.int64)  # row * NB + block, one flat grid
    row = cell // NB
    blk = cell - row * NB
    i = tl.arange(0, BLOCK)
    t = blk * BLOCK + i
    return cell, row, i, t, t < T, row * T


@triton.jit
def plane_size(B, NB):
    """``B·NB`` in int64: one plane of block maps (``k`` planes are offsets of three sizes)."""
    return tl.cast(B, tl.int64) * NB


@triton.jit
def _scan_block(
    x_ptr, a_ptr, y_ptr, summ_ptr, carry_ptr, B, T, NB,
    PER_TOKEN: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    cell, row, i, t, ok, base = block_cell(T, NB, BLOCK)
    x = tl.load(x_ptr + base + t, mask=ok, other=0.0).to(ACC)
    if PER_TOKEN:
        a = tl.load(a_ptr + base + t, mask=ok, other=1.0).to(ACC)
    else:
        a = tl.where(ok, tl.load(a_ptr + row).to(ACC), 1.0)
    p, c = tl.associative_scan((a, x), 0, compose1, reverse=True)
    if FINAL:
        y_in = tl.load(carry_ptr + cell).to(ACC)
        y = c + p * tl.where(p == 0, 0.0, y_in)
        tl.store(y_ptr + base + t, cast_to(y, y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(summ_ptr + cell, block_head(p, i))
        tl.store(summ_ptr + plane_size(B, NB) + cell, block_head(c, i))


@triton.jit
def _carry_kernel(summ_ptr, init_ptr, carry_ptr, B, NB, TWO: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: the state entering each block from the right. The row's blocks go
    # in tiles of BLOCK from block 0 (a block's lane never depends on NB: padding to the right
    # adds identity maps after the row's own), the last tile first. Lane i of a tile composes
    # the maps of blocks k+1 .. the tile's end (a reverse scan) and applies them to the state
    # entering the tile from the right: lane 0 of the tile after it.
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    plane = plane_size(B, NB)
    rb = row * NB
    a_in = tl.load(init_ptr + row)
    w_in = a_in
    if TWO:
        w_in = tl.load(init_ptr + B + row)
    tiles = tl.cdiv(NB, BLOCK)
    for j in range(tiles):
        k = (tiles - 1 - j) * BLOCK + i
        src = k + 1
        ok = src < NB
        p = tl.load(summ_ptr + rb + src, mask=ok, other=1.0)
        if TWO:
            q = tl.load(summ_ptr + plane + rb + src, mask=ok, other=0.0)
            s = tl.load(summ_ptr + 2 * plane + rb + src, mask=ok, other=1.0)
            c = tl.load(summ_ptr + 3 * plane + rb + src, mask=ok, other=0.0)
            e = tl.load(summ_ptr + 4 * plane + rb + src, mask=ok, other=0.0)
            p, q, s, c, e = tl.associative_scan((p, q, s, c, e), 0, compose2, reverse=True)
            a = c + p * tl.where(p == 0, 0.0, a_in) + q * tl.where(q == 0, 0.0, w_in)
            w = e + s * tl.where(s == 0, 0.0, w_in)
            tl.store(carry_ptr + plane + rb + k, w, mask=k < NB)
            w_in = block_head(w, i)
        else:
            c = tl.load(summ_ptr + plane + rb + src, mask=ok, other=0.0)
            p, c = tl.associative_scan((p, c), 0, compose1, reverse=True)
            a = c + p * tl.where(p == 0, 0.0, a_in)
        tl.store(carry_ptr + rb + k, a, mask=k < NB)
        a_in = block_head(a, i)


def block_size(block_t: int | None = None) -> int:
    """Time steps per program: ``block_t`` (a power of two, at least 16) if given, else
    :data:`BLOCK_T`. Never chosen from the shape (module docstring: batch invariance)."""
    if block_t is None:
        return BLOCK_T
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 1, got {block_t}")
    return max(block_t, 16)


def num_warps(block: int, acc: torch.dtype) -> int:
    """Warps per program of ``block`` lanes carried in ``acc``: 16 bytes of each input per thread
    (float64 takes twice the warps: ptxas spilled the float64 GAE at four a thread), at least one;
    a function of the block, the dtype and the target, never of the shape.
    """
    return max(1, block * acc.itemsize // (16 * warp_size()))


def block_carries(summaries: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """The state entering every block from the right.

    ``summaries``: ``[2, B, NB]`` block maps ``(p, c)`` or ``[5, B, NB]`` ``(p, q, s, c, e)``;
    ``init``: ``[1, B]`` or ``[2, B]``, the state past the end of each row. Returns
    ``[1 | 2, B, NB]`` in the summaries' dtype."""
    _, b, nb = summaries.shape
    two = summaries.shape[0] == 5
    carries = torch.empty((2 if two else 1, b, nb), dtype=summaries.dtype, device=summaries.device)
    if b == 0 or nb == 0:
        return carries
    if nb == 1:
        return carries.copy_(init.unsqueeze(-1))
    block = _CARRY_BLOCK
    init = init.to(summaries.dtype).contiguous()
    launch(_carry_kernel, (b,), summaries, init, carries, b, nb, TWO=two, BLOCK=block,
           num_warps=num_warps(block, summaries.dtype))  # fmt: skip
    return carries


def _scan_forward(x, a, y_boot, block_t):
    """``y`` for ``x`` ``[B, T]`` contiguous, ``a`` ``[B]`` or ``[B, T]`` contiguous (any float
    dtype), ``y_boot`` ``[B]`` in the carry dtype; ``y`` in ``x``'s dtype."""
    b, t_len = x.shape
    y = torch.empty_like(x)
    if b == 0 or t_len == 0:
        return y
    acc = acc_dtype(x.dtype, a.dtype)
    per_token = a.dim() == 2
    block = block_size(block_t)
    nb = triton.cdiv(t_len, block)
    warps = num_warps(block, acc)
    common = dict(PER_TOKEN=per_token, BLOCK=block, ACC=tl_dtype(acc), num_warps=warps)
    grid = (b * nb,)
    if nb == 1:
        carries = y_boot.reshape(1, b, 1)
    else:
        summ = torch.empty((2, b, nb), dtype=acc, device=x.device)
        launch(_scan_block, grid, x, a, y, summ, summ, b, t_len, nb, FINAL=False, **common)
        carries = block_carries(summ, y_boot.reshape(1, b))
    launch(_scan_block, grid, x, a, y, carries, carries, b, t_len, nb, FINAL=True, **common)
    return y


def _canonical(x: torch.Tensor, a, y_boot):
    """``(x [B, T], decay [B] or [B, T], y_boot [B] in the carry dtype)``, checked."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [B, T] tensor, got {x.dtype} {list(x.shape)}")
    b, t_len = x.shape
    if isinstance(a, torch.Tensor):
        if not a.is_floating_point():
            raise TypeError(f"a must be a float or a floating tensor, got {a.dtype}")
        shape = tuple(a.shape)
        if shape in ((b,), (b, 1)) or (shape == (b, t_len) and t_len == 1):
            dec = a.reshape(b)
        elif shape == (b, t_len):
            dec = a
        else:
            raise ValueError(
                f"a must be a float, [B] or [B, 1] (per row) or [B, T] (per token) with "
                f"[B, T] = {[b, t_len]}, got {list(shape)}"
            )
    else:
        dec = torch.full((b,), float(a), dtype=acc_dtype(x.dtype), device=x.device)
    acc = acc_dtype(x.dtype, dec.dtype)
    if y_boot is None:
        boot = torch.zeros(b, dtype=acc, device=x.device)
    elif isinstance(y_boot, torch.Tensor):
        if y_boot.numel() != b:
            raise ValueError(f"y_boot must be [B] or [B, 1] with B = {b}, got {list(y_boot.shape)}")
        boot = y_boot.reshape(b).to(acc)
    else:
        boot = torch.full((b,), float(y_boot), dtype=acc, device=x.device)
    return x.contiguous(), dec.contiguous(), boot.contiguous()


class ReverseScan(torch.autograd.Function):
    """Autograd of the reverse scan: ``gx[t] = g[t] + a[t-1]·gx[t-1]`` (these kernels on the
    reversed time axis), ``ga[t] = gx[t]·y[t+1]`` (0 at a cut; a per-row decay's gradient its row
    sum), ``g_boot = gx[T-1]·a[T-1]``.
    """

    @staticmethod
    def forward(ctx, x, decay, y_boot, block_t):
        y = _scan_forward(x, decay, y_boot, block_t)
        ctx.block_t = block_t
        ctx.save_for_backward(decay, y, y_boot)
        return y

    @staticmethod
    def backward(ctx, g):
        decay, y, y_boot = ctx.saved_tensors
        b, t_len = y.shape
        if t_len == 0:
            return torch.zeros_like(g), None, torch.zeros_like(y_boot), None
        per_token = decay.dim() == 2
        acc = acc_dtype(g.dtype, decay.dtype)
        if per_token:  # decay'[s] = a[T-2-s]; nothing follows s = T-1
            shifted = torch.cat([decay[:, :-1].flip(-1), decay.new_zeros(b, 1)], dim=1)
        else:
            shifted = decay
        zero = torch.zeros(b, dtype=acc, device=g.device)
        gx = _adjoint(g.flip(-1).contiguous(), shifted.contiguous(), zero, ctx.block_t)
        gx = gx.flip(-1)
        a_full = decay if per_token else decay.unsqueeze(1).expand(b, t_len)
        gx_acc = gx.to(acc)
        g_boot = None
        if ctx.needs_input_grad[2]:
            g_boot = (gx_acc[:, -1] * a_full[:, -1].to(acc)).to(y_boot.dtype)
        g_dec = None
        if ctx.needs_input_grad[1]:
            nxt = torch.cat([y[:, 1:].to(acc), y_boot.reshape(b, 1).to(acc)], dim=1)
            ga = gx_acc * torch.where(a_full == 0, 0.0, nxt)
            g_dec = (ga if per_token else ga.sum(dim=1)).to(decay.dtype)
        return gx, g_dec, g_boot, None


def _adjoint(g, shifted, zero, block_t):
    """The backward's scan (on the reversed gradient): the kernels, or, where they cannot be
    built, the chunked scan (the triton backend set aside, one warning)."""
    if failed("triton") is None:
        try:
            return _scan_forward(g, shifted, zero, block_t)
        except KernelBuildError as e:
            set_failed("triton", e, "the triton backend (the scan's backward)")
    from rlops.scan.chunked import scan_chunked

    acc = zero.dtype
    dec = shifted.to(acc) if shifted.dim() == 2 else shifted.to(acc).reshape(-1, 1)
    return scan_chunked(g.to(acc), dec).to(g.dtype)


def reverse_scan(
    x: torch.Tensor,
    a: float | torch.Tensor,
    *,
    y_boot: float | torch.Tensor | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """``y[t] = x[t] + a[t]·y[t+1]``, ``y[T] = y_boot``, over ``x`` ``[B, T]`` in Triton.

    Args:
        x: ``[B, T]`` floating (half dtypes accumulate in float32, float64 in float64).
        a: a float, a per-row tensor ``[B]`` / ``[B, 1]`` or a per-token ``[B, T]`` tensor.
            A decay of exactly 0 is an exact cut.
        y_boot: the value past the end of each row: a float or ``[B]`` / ``[B, 1]`` (0).
        block_t: time steps per program (a power of two); default :data:`BLOCK_T`, whatever
            the shape (:func:`block_size`).

    Returns:
        ``y`` ``[B, T]`` in ``x``'s dtype; differentiable w.r.t. ``x``, a tensor ``a`` and a
        tensor ``y_boot`` (:class:`ReverseScan`).

    Example:
        >>> import torch
        >>> reverse_scan(torch.tensor([[1.0, 1.0, 1.0]]), 0.5)  # doctest: +SKIP
        tensor([[1.7500, 1.5000, 1.0000]])
    """
    x2, dec, boot = _canonical(x, a, y_boot)
    return ReverseScan.apply(x2, dec, boot, block_t)
