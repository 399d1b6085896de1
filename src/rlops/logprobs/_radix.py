"""The sampler's threshold over a sharded vocabulary by radix select, in a fixed number of
all-reduces: top-p without top-k, and a per-token top-k (with or without top-p / min-p).

The merge of each shard's top-k candidates (:func:`rlops.logprobs._support.candidates_chunk`)
needs one scalar k for every token; top-p alone would need every logit. Instead, every scaled
logit is mapped to an integer key with the same order (:func:`float_key`), and the threshold's
key is found one byte at a time, from the most significant: in each round every shard counts,
per token, its logits whose key starts with the bytes found so far, in 256 bins by the next
byte (the number of logits, and for top-p their mass ``exp(z − M)``); one all-reduce sums the
histograms over the shards, and every rank picks the same bin:

- top-k (count select): the bin in which the count from the top reaches ``k``, so that after
  the last round the key is that of the k-th largest value (``k ≥ V`` selects the smallest);
- top-p (mass select, over the logits ``≥`` the min-p / top-k threshold ``t``): the first bin,
  from the bottom, holding a logit whose mass strictly above it (all the bins above and what
  the previous rounds left above) is ``< p·S``, ``S`` the mass of the logits ``≥ t``. That
  logit is the one at which the sorted-descending cumulative mass before it first reaches
  ``p·S``: the crossing token of :func:`rlops.logprobs._support.threshold_chunk`, and its ties
  are all kept (the support is ``z ≥`` its value).

Rounds: one per byte of the key, 4 for float32 (the compute dtype of float32 and half logits)
and 8 for float64. One all-reduce MAX of ``[N]`` first gives the global per-token max ``M``
(min-p's reference, and top-p's mass scale); a per-token top-k with top-p runs the count select
then the mass select. So, per forward: top-p (with or without min-p) ``1 + R`` all-reduces;
a per-token top-k ``R`` alone, ``1 + R`` with min-p, ``1 + 2R`` with top-p; none reads a value
on the host or branches on one. Each round is one more pass over the logit chunks (the fused
linear op recomputes each chunk's matmul per round). Counts are held in the compute dtype:
exact up to ``2**24`` tokens per vocabulary in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from rlops.logprobs._plan import Plan
from rlops.logprobs._support import Sampler

__all__ = ["float_key", "key_float", "radix_threshold", "rounds", "uses_radix"]

_BINS = 256
# The bits flipped in a negative float's pattern (all but the sign), per compute dtype.
_MAGNITUDE = {torch.float32: (1 << 31) - 1, torch.float64: (1 << 63) - 1}
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
# ``logits(i, j)``: ``(scaled logits of tokens i:j in the compute dtype, own)`` of this shard.
Logits = Callable[[int, int], tuple[torch.Tensor, bool]]


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
    """int64 keys of float32 / float64 values with their order: ``x < y`` ⇒ key ``<`` key.

    The usual unsigned key (a negative float's bits all flipped, a positive one's sign bit set)
    with its top bit flipped, so that the signed int64 order is the float order: a positive
    float keeps its bits, a negative one flips all but its sign bit. ``-0.0`` sits just below
    ``+0.0``, ``-inf`` below every finite value; NaNs map to keys beyond ``±inf`` (by sign).
    """
    bits = z.view(_INT[z.dtype]).to(torch.int64)
    return torch.where(bits < 0, bits ^ _MAGNITUDE[z.dtype], bits)


def key_float(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`float_key`: the values of int64 ``key`` in ``dtype``."""
    bits = torch.where(key < 0, key ^ _MAGNITUDE[dtype], key)
    return bits.to(_INT[dtype]).view(dtype)


def _histograms(
    plan: Plan,
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
    plan: Plan,
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


def radix_threshold(plan: Plan, logits: Logits) -> torch.Tensor:
    """``[N, 1]`` thresholds of the plan's sampler over the vocabulary sharded on its group,
    equal to :func:`rlops.logprobs._support.threshold_chunk` on the full vocabulary.

    ``logits(i, j)`` gives ``(scaled logits of tokens i:j in the compute dtype, own)``, this
    shard's columns; it is called once per chunk in each pass (one for the max, one per round).
    """
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
