"""The sampler's support (min-p, top-k, top-p) as a per-token threshold: ``z ≥ t``.

In one process each chunk finds its threshold (:func:`threshold_chunk`); over a sharded
vocabulary the shards merge their top-k candidates (:func:`candidates_chunk`,
:func:`merged_threshold`) or run a radix select (:func:`radix_threshold`: top-p without top-k,
a per-token top-k). A CSR support becomes each chunk's keep mask (:func:`chunk_keep`). The
rules, vLLM's order and the collectives' count: ``docs/design/logprobs.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist

from rlops._checks import values_checked
from rlops._types import Group

# A per-token parameter is a [C, 1] tensor (rows of the chunk); a scalar is a Python number.
TopK = int | torch.Tensor | None
TopP = float | torch.Tensor | None


@dataclass(frozen=True)
class Sampler:
    """The checked sampler parameters: scalars, or per-token ``[N]`` tensors (flattened)."""

    top_k: TopK
    top_p: TopP
    min_p: TopP

    def rows(self, i: int, j: int) -> tuple[TopK, TopP, TopP]:
        """The parameters of rows ``[i, j)``: scalars as they are, tensors as ``[C, 1]``."""
        return _rows(self.top_k, i, j), _rows(self.top_p, i, j), _rows(self.min_p, i, j)

    def compacted(self, rows: torch.Tensor) -> Sampler:
        """The same sampler on the rows ``rows`` ``[n]`` int64 (its per-token tensors
        gathered)."""

        def pick(p):
            return p.index_select(0, rows) if isinstance(p, torch.Tensor) else p

        return Sampler(pick(self.top_k), pick(self.top_p), pick(self.min_p))

    def capped(self, vocab: int) -> Sampler:
        """The same sampler with an int ``top_k`` capped at the vocabulary size ``vocab``
        (``k ≥ V`` keeps every token); ``self`` is left as it is."""
        if isinstance(self.top_k, int) and self.top_k > vocab:
            return replace(self, top_k=vocab)
        return self


def _rows(p, i: int, j: int):
    return p[i:j].unsqueeze(1) if isinstance(p, torch.Tensor) else p


def _log(x: float | torch.Tensor) -> float | torch.Tensor:
    return x.log() if isinstance(x, torch.Tensor) else math.log(x)


def _maximum(t: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    return u if t is None else torch.maximum(t, u)


def threshold_chunk(z: torch.Tensor, top_k: TopK, top_p: TopP, min_p: TopP) -> torch.Tensor:
    """``[C, 1]``: the support's threshold per token of scaled logits ``z`` (not modified), ``-inf``
    where every token is kept. Each parameter: a scalar, a ``[C, 1]`` tensor, or None (off)."""
    v = z.shape[1]
    if isinstance(top_p, float) and top_p >= 1.0:
        top_p = None
    if isinstance(top_k, int) and top_k >= v:
        top_k = None
    t = None
    if min_p is not None and not (isinstance(min_p, float) and min_p == 0.0):
        t = z.amax(dim=1, keepdim=True) + _log(min_p)  # min_p = 0: -inf, keeps everything
    if top_p is None and not isinstance(top_k, torch.Tensor):
        if top_k is not None:
            t = _maximum(t, z.topk(top_k, dim=1, sorted=False).values.amin(dim=1, keepdim=True))
        return z.new_full((z.shape[0], 1), float("-inf")) if t is None else t
    extra = None  # tokens >= t left out of zs (ties with the k-th value)
    if isinstance(top_k, int):  # top-p then needs only the k largest values, sorted
        zs = z.topk(top_k, dim=1).values
        t = _maximum(t, zs[:, -1:])
        extra = (z >= t).sum(dim=1, keepdim=True) - (zs >= t).sum(dim=1, keepdim=True)
    else:
        zs = z.sort(dim=1, descending=True).values
        if top_k is not None:
            t = _maximum(t, zs.gather(1, top_k.clamp(1, v) - 1))
    if top_p is not None:
        t = _maximum(t, _top_p_threshold(zs, t, top_p, extra))
    return z.new_full((z.shape[0], 1), float("-inf")) if t is None else t


def _top_p_threshold(
    zs: torch.Tensor,
    t: torch.Tensor | None,
    top_p: float | torch.Tensor,
    extra: torch.Tensor | None,
) -> torch.Tensor:
    """Top-p's threshold from the values ``zs`` ``[C, K]`` sorted descending (all those
    ``≥ t``, but ``extra`` ``[C, 1]`` more tokens tied at ``t``): the value of the token at
    which the mass before it, over the tokens ``≥ t``, first reaches ``top_p``."""
    top = zs[:, :1]
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w = (zs if t is None else zs.masked_fill(zs < t, float("-inf"))).sub(top).exp_()
    total = w.sum(dim=1, keepdim=True)
    if extra is not None and t is not None:  # the left-out ties, all at value t
        total = total + extra * (t - top).exp()
    # the mass strictly before each sorted position (a concatenation, not a cumsum into a
    # slice: torch.compile refuses an out= tensor that is not contiguous)
    before = torch.cat([torch.zeros_like(w[:, :1]), w[:, :-1].cumsum(dim=1)], dim=1)
    n_keep = (before < top_p * total).sum(dim=1, keepdim=True)  # a prefix: monotone
    t_p = zs.gather(1, (n_keep - 1).clamp(min=0))
    if isinstance(top_p, torch.Tensor):  # p = 1 keeps every token, whatever the rounding
        t_p = t_p.masked_fill(top_p >= 1.0, float("-inf"))
    return t_p


def support_applied(
    z: torch.Tensor,
    own: bool,
    idx: torch.Tensor,
    in_range: torch.Tensor,
    threshold: torch.Tensor,
    over_support: bool,
) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """The sampler's support ``z ≥ threshold`` on a chunk: ``(z, own, keep)``. Without
    ``over_support`` it is the keep mask; with it the logits outside (the target always in)
    become ``-inf`` and no mask is needed."""
    keep = z >= threshold
    if not over_support:
        return z, own, keep
    keep.scatter_(1, idx, keep.gather(1, idx) | in_range)
    z = z.masked_fill_(~keep, float("-inf")) if own else z.masked_fill(~keep, float("-inf"))
    return z, True, None


# --------------------------------------------------------------------------- tensor parallel
def n_candidates(top_k: int | None) -> int:
    """Columns of :func:`candidates_chunk`: ``K`` values, the K-th again, the ties left out."""
    return (top_k or 1) + 2


def candidates_chunk(z: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``[C, K + 2]``: this shard's ``K = top_k`` largest values, descending (``-inf``-padded;
    ``K = 1``, the max, without top-k), its K-th value ``v`` and how many of its tokens ``≥ v``
    were left out (ties): the global threshold follows exactly (:func:`merged_threshold`)."""
    k = top_k or 1
    kk = min(k, z.shape[1])
    vals = z.topk(kk, dim=1).values
    last = vals[:, -1:]
    left_out = (z >= last).sum(dim=1, keepdim=True) - kk
    pad = vals.new_full((z.shape[0], k - kk), float("-inf"))
    return torch.cat([vals, pad, last, left_out.to(z.dtype)], dim=1)


def merged_threshold(
    gathered: torch.Tensor, top_k: int | None, top_p: TopP, min_p: TopP
) -> torch.Tensor:
    """``[R, N, K + 2]`` candidates of every shard → the global threshold ``[N, 1]``, the same
    as :func:`threshold_chunk` on the full vocabulary (top-p needs top-k here)."""
    r, n, cols = gathered.shape
    k = cols - 2
    zs = gathered[:, :, :k].permute(1, 0, 2).reshape(n, r * k).sort(dim=1, descending=True).values
    t = None
    if min_p is not None and not (isinstance(min_p, float) and min_p == 0.0):
        t = zs[:, :1] + _log(min_p)
    if top_k is not None:
        t = _maximum(t, zs[:, top_k - 1 : top_k])
    if isinstance(top_p, float) and top_p >= 1.0:
        top_p = None
    if top_p is not None:
        assert t is not None, "top-p over the shards' candidates needs top_k (else: radix select)"
        last, left_out = gathered[:, :, k], gathered[:, :, k + 1]
        extra = torch.where(last == t.view(1, n), left_out, torch.zeros_like(left_out))
        t = _maximum(t, _top_p_threshold(zs, t, top_p, extra.sum(dim=0).unsqueeze(1)))
    return zs.new_full((n, 1), float("-inf")) if t is None else t


# --------------------------------------------------------------------------- CSR support sets
def csr_entries(
    ids: torch.Tensor, offsets: torch.Tensor, rows_of: torch.Tensor | None, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSR support as ``(rows, ids)`` ``[nnz']`` pairs, rows non-decreasing (int32 below ``2³¹``
    entries and rows; a ``searchsorted``, no host read); with ``rows_of`` (a compacted row mask)
    renumbered to the compacted rows, the others' entries dropped."""
    ids = ids.long()
    e = torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
    small = ids.numel() < 2**31 and total < 2**31  # int32 rows: half the bytes kept per entry
    rows = torch.searchsorted(offsets[1:].long().contiguous(), e, right=True, out_int32=small)
    del e
    if rows_of is None:
        return rows, ids
    pos = torch.full((total,), -1, dtype=torch.int64, device=ids.device)
    pos[rows_of] = torch.arange(rows_of.numel(), dtype=torch.int64, device=ids.device)
    rows = pos[rows]
    kept = rows >= 0
    return rows[kept], ids[kept]


def chunk_keep(
    rows: torch.Tensor, ids: torch.Tensor, i: int, c: int, start: int, v_local: int
) -> torch.Tensor:
    """``[c, v_local]`` bool: the keep mask of rows ``i : i + c`` over ids ``[start, start +
    v_local)`` from CSR pairs (rows non-decreasing). On CPU where values are read, the chunk's
    entries are found by a ``searchsorted``; elsewhere every entry is tested (no host read)."""
    keep = torch.zeros(c * v_local + 1, dtype=torch.bool, device=rows.device)
    # the host path on CPU only: on an accelerator RLOPS_CHECK_VALUES=1 makes the value checks
    # read, never this path (its CPU bounds would meet device rows; the hot path must not change)
    if rows.device.type == "cpu" and values_checked(rows):
        bounds = torch.tensor([i, i + c], dtype=rows.dtype)
        lo, hi = (int(b) for b in torch.searchsorted(rows, bounds))
        rows, ids = rows[lo:hi], ids[lo:hi]
        pos = ((ids >= start) & (ids < start + v_local)).nonzero().squeeze(1)
        flat = (rows.index_select(0, pos).long() - i).mul_(v_local)
        flat.add_(ids.index_select(0, pos)).sub_(start)
        keep[flat] = True
        return keep[: c * v_local].view(c, v_local)
    flat = rows.long() - i
    ok = (flat >= 0) & (flat < c) & (ids >= start) & (ids < start + v_local)
    flat.mul_(v_local).add_(ids).sub_(start).masked_fill_(~ok, c * v_local)
    keep[flat] = True
    return keep[: c * v_local].view(c, v_local)


# --------------------------------------------------------------------------- radix select
_BINS = 256
# The bits flipped in a negative float's pattern (all but the sign), per compute dtype.
_MAGNITUDE = {torch.float32: (1 << 31) - 1, torch.float64: (1 << 63) - 1}
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
# ``logits(i, j)``: ``(scaled logits of tokens i:j in the compute dtype, own)`` of this shard.
Logits = Callable[[int, int], tuple[torch.Tensor, bool]]


class Passes(Protocol):
    """What the radix select reads of the engine's plan: the rows, their chunks, the group."""

    @property
    def rows(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def group(self) -> Group: ...
    @property
    def sampler(self) -> Sampler | None: ...
    @property
    def starts(self) -> range: ...


def uses_radix(sampler: Sampler) -> bool:
    """Whether the sharded threshold needs the radix select: a per-token top-k, or top-p
    (below 1) without top-k; else the candidates' merge serves (a scalar top-k, or min-p)."""
    top_p = sampler.top_p
    no_top_p = top_p is None or (not isinstance(top_p, torch.Tensor) and top_p >= 1.0)
    return isinstance(sampler.top_k, torch.Tensor) or (sampler.top_k is None and not no_top_p)


def rounds(dtype: torch.dtype) -> int:
    """Radix rounds (key bytes) for the compute dtype: 4 for float32, 8 for float64."""
    return 8 if dtype == torch.float64 else 4


def float_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 / float64 values with their order (a negative float's bits flipped
    but its sign): ``-0.0`` just below ``+0.0``, ``-inf`` below every finite value."""
    bits = z.view(_INT[z.dtype]).to(torch.int64)
    return torch.where(bits < 0, bits ^ _MAGNITUDE[z.dtype], bits)


def key_float(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`float_key`: the values of int64 ``key`` in ``dtype``."""
    bits = torch.where(key < 0, key ^ _MAGNITUDE[dtype], key)
    return bits.to(_INT[dtype]).view(dtype)


def _histograms(
    plan: Passes,
    logits: Logits,
    shift: int,
    prefix: torch.Tensor | None,
    *,
    lower: torch.Tensor | None,
    ref: torch.Tensor | None,
) -> torch.Tensor:
    """``[1 or 2, N, 256]``: per token, the count (and with ``ref``, the mass ``exp(z − ref)``)
    of this shard's logits ``≥ lower`` whose key above bit ``shift + 8`` is ``prefix``
    (all of them when ``prefix`` is None), binned by the key's byte at ``shift``."""
    dtype = plan.dtype
    hist = torch.zeros((1 if ref is None else 2, plan.rows, _BINS), dtype=dtype, device=plan.device)
    for i in plan.starts:
        z = logits(i, i + plan.chunk)[0]
        j = i + z.shape[0]
        key = float_key(z)
        if prefix is None:  # the top byte, signed: -128..127
            bins = (key >> shift) + _BINS // 2
            keep = None
        else:
            bins = (key >> shift) & (_BINS - 1)
            keep = (key >> (shift + 8)) == prefix[i:j]
        if lower is not None:
            above = z >= lower[i:j]
            keep = above if keep is None else keep & above
        ones = torch.ones_like(z) if keep is None else keep.to(dtype)
        hist[0, i:j].scatter_add_(1, bins, ones)
        if ref is not None:
            hist[1, i:j].scatter_add_(1, bins, (z - ref[i:j]).exp_().mul_(ones))
    return hist


def _exclusive_from_top(x: torch.Tensor) -> torch.Tensor:
    """``[N, 256]`` → per bin, the sum over the bins above it (exclusive)."""
    incl = x.flip(1).cumsum(1).flip(1)
    return torch.cat([incl[:, 1:], torch.zeros_like(incl[:, :1])], dim=1)


def _select(
    plan: Passes,
    logits: Logits,
    *,
    k: torch.Tensor | None = None,
    p: float | torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    lower: torch.Tensor | None = None,
) -> torch.Tensor:
    """The key ``[N, 1]`` int64 of the k-th largest value (``k`` given) or of top-p's crossing
    value among the logits ``≥ lower`` (``p``, masses relative to ``ref``): one all-reduce of
    the summed histograms per round, the same bin picked on every rank."""
    dtype = plan.dtype
    bins = torch.arange(_BINS, device=plan.device)
    prefix: torch.Tensor | None = None
    target: torch.Tensor | None = None  # top-p: p·S, the mass to reach
    above: torch.Tensor | None = None  # top-p: the mass above the prefix found so far
    left = None if k is None else k.to(dtype).clamp(min=1)  # top-k: the rank still to reach
    n_rounds = rounds(dtype)
    for r in range(n_rounds):
        shift = 8 * (n_rounds - 1 - r)
        hist = _histograms(plan, logits, shift, prefix, lower=lower, ref=ref)
        dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=plan.group)
        count = hist[0]
        count_above = _exclusive_from_top(count)
        if left is not None:
            if r == 0:  # k >= V: the smallest value, which keeps every logit
                left = torch.minimum(left, count_above[:, :1] + count[:, :1])
            b = ((count_above + count) >= left).sum(dim=1, keepdim=True).sub_(1).clamp_(0)
            left = left - count_above.gather(1, b)
        elif p is not None:
            mass, mass_above = hist[1], _exclusive_from_top(hist[1])
            if target is None or above is None:  # the first round
                above = torch.zeros_like(mass[:, :1])
                target = p * (mass_above[:, :1] + mass[:, :1])  # p·S
            kept = (count > 0) & (above + mass_above < target)
            first = torch.where(kept, bins, _BINS).amin(dim=1, keepdim=True)
            # None kept (S = 0: every logit -inf): the largest, as threshold_chunk.
            top = torch.where(count > 0, bins, 0).amax(dim=1, keepdim=True)
            b = torch.where(first < _BINS, first, top)
            above = above + mass_above.gather(1, b)
        else:
            raise ValueError("_select needs k or p")
        prefix = b - _BINS // 2 if prefix is None else prefix * _BINS + b
    assert prefix is not None
    return prefix


def radix_threshold(plan: Passes, logits: Logits) -> torch.Tensor:
    """``[N, 1]`` thresholds of the plan's sampler over the sharded vocabulary, equal to
    :func:`threshold_chunk` on the whole of it; ``logits(i, j)`` is read once per chunk and pass."""
    if plan.sampler is None:
        raise ValueError("radix_threshold needs a plan with a sampler")
    n, dtype, device, group = plan.rows, plan.dtype, plan.device, plan.group
    top_k, top_p, min_p = plan.sampler.rows(0, n)
    if not isinstance(top_p, torch.Tensor) and top_p is not None and top_p >= 1.0:
        top_p = None
    use_min_p = min_p is not None and not (not isinstance(min_p, torch.Tensor) and min_p == 0.0)
    inf = float("-inf")
    t: torch.Tensor | None = None
    m: torch.Tensor | None = None  # the global max of each token's logits
    if top_p is not None or use_min_p:
        m = torch.full((n, 1), inf, dtype=dtype, device=device)
        for i in plan.starts:
            z = logits(i, i + plan.chunk)[0]
            m[i : i + z.shape[0]] = z.amax(dim=1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        if isinstance(min_p, torch.Tensor):
            t = m + min_p.log()
        elif use_min_p and min_p is not None:
            t = m + math.log(min_p)
    if top_k is not None:
        k = top_k if isinstance(top_k, torch.Tensor) else torch.full((n, 1), top_k, device=device)
        t_k = key_float(_select(plan, logits, k=k), dtype)
        t = t_k if t is None else torch.maximum(t, t_k)
    if top_p is not None and m is not None:
        ref = torch.where(m == inf, torch.zeros_like(m), m)
        t_p = key_float(_select(plan, logits, p=top_p, ref=ref, lower=t), dtype)
        if isinstance(top_p, torch.Tensor):  # p = 1 keeps every token, whatever the rounding
            t_p = t_p.masked_fill(top_p >= 1.0, inf)
        t = t_p if t is None else torch.maximum(t, t_p)
    return torch.full((n, 1), inf, dtype=dtype, device=device) if t is None else t
