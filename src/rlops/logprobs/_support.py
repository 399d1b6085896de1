"""The sampler's support (min-p, top-k, top-p) of one chunk of scaled logits, as a threshold.

Every filter keeps the logits at or above a per-token threshold, so the support of a chunk
``z`` ``[C, V]`` (already divided by the temperature, in the compute dtype) is ``z ≥ t`` with
``t`` ``[C, 1]``. The filters compose in vLLM's order (``vllm/v1/sample``: temperature, then
min-p, then top-k and top-p on what is left):

- min-p: ``p_v ≥ min_p · max p`` ⇔ ``z_v ≥ max z + log min_p``;
- top-k: ``t_k`` = the k-th largest value; every logit ``≥ t_k`` is kept, so ties with the
  k-th value are all kept (vLLM's ``apply_top_k_only`` and ``apply_top_k_top_p`` mask
  ``logits < k-th value``);
- top-p: over the distribution renormalised on what min-p and top-k kept, sorted descending,
  the smallest prefix whose mass reaches ``p`` (the token that crosses ``p`` is kept: its mass
  *before* it is ``< p``); ``t_p`` is that token's value, and every logit ``≥ t_p`` is kept.
  vLLM sorts ascending and drops the positions whose cumulative mass is ``≤ 1 − p``, the same
  rule except at a tie across the boundary, where it keeps an arbitrary (sort-order) subset of
  the tied tokens; keeping them all makes the support a function of the values alone.

The forward saves the threshold (one number per token) and the backward rebuilds the support
as ``z ≥ t`` from it, so both see the same support without sorting again. It is piecewise
constant in the logits: no gradient flows through it.

Cost per chunk: min-p a max; top-k alone a ``topk``; top-k with top-p a sorted ``topk`` of k
values and one count of the ties it left out (all at the threshold); top-p without top-k (or a
per-token top-k) a full sort of the chunk, the expensive case.

Vocabulary shards (tensor parallel): the global k largest values lie among the shards' own k
largest, so each shard sends those, its k-th value and the count of its ties with it left out
(:func:`candidates_chunk`), and every rank derives the same global threshold
(:func:`merged_threshold`). Top-p is then taken over the top-k candidates, which is why this
merge needs a scalar top-k; top-p without top-k and a per-token top-k use the radix select of
:mod:`rlops.logprobs._radix` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from rlops._checks import values_checked

__all__ = [
    "Sampler",
    "candidates_chunk",
    "chunk_keep",
    "csr_entries",
    "merged_threshold",
    "n_candidates",
    "threshold_chunk",
]

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
    """``[C, 1]``: the support's threshold per token of scaled logits ``z`` (not modified);
    ``-inf`` where every token is kept.

    ``top_k``: int ``≥ 1`` or ``[C, 1]`` int64 (values ``≥ V`` keep everything); ``top_p``:
    float in ``(0, 1]`` or ``[C, 1]`` in ``z``'s dtype; ``min_p``: float in ``[0, 1]`` or
    ``[C, 1]``; None: that filter is off.
    """
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


# --------------------------------------------------------------------------- tensor parallel
def n_candidates(top_k: int | None) -> int:
    """Columns of :func:`candidates_chunk`: ``K`` values, the K-th again, the ties left out."""
    return (top_k or 1) + 2


def candidates_chunk(z: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``[C, K + 2]``: one vocabulary shard's candidates for the global threshold.

    The shard's ``K = top_k`` largest values sorted descending (``-inf``-padded when the shard
    holds fewer; ``K = 1``, the max, without top-k), its K-th value ``v`` and the number of its
    tokens ``≥ v`` left out (ties with ``v``). The global k largest values lie among the
    shards' candidates, and every token ``≥`` the global k-th value not among them is such a
    tie, so the threshold follows from the candidates exactly (:func:`merged_threshold`).
    """
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
    """A CSR support (``ids`` ``[nnz]``, ``offsets`` ``[total + 1]``) as ``(rows, ids)``
    ``[nnz']`` pairs, rows non-decreasing: ids int64, rows int32 (int64 from ``2³¹`` entries
    or rows on, and where a compacted row mask renumbers them).

    The row of entry ``e`` is the number of ``offsets[1:]`` at or below ``e`` (a
    ``searchsorted``: no host read). ``rows_of`` (the valid rows of a compacted row mask,
    increasing): the rows renumbered to their compacted positions and the entries of the other
    rows dropped (a host-sized selection, on the host path only)."""
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
    """``[c, v_local]`` bool: the keep mask of rows ``i : i + c`` over the vocabulary ids
    ``[start, start + v_local)``, from CSR pairs ``(rows, ids)`` (rows non-decreasing). A
    duplicate id sets the same entry twice: a set, the same as once.

    On CPU where values are read (:func:`values_checked`): the chunk's entries found by a
    ``searchsorted``, those in the vocabulary range selected (a host-sized index), and set; the
    temporaries beside the mask are a few bytes per entry of the chunk. Elsewhere, accelerators
    with ``RLOPS_CHECK_VALUES=1`` included (no host read): every entry is tested against the
    chunk and the range, those outside written to one spare element (``O(nnz)`` per chunk, one
    int64 and a few bool temporaries of ``nnz``)."""
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
