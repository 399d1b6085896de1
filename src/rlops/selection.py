"""Token and sequence selection masks that do not change with the micro-batch split.

Each function returns a keep mask (a subset of ``mask``) and detached 0-dim metrics:

* :func:`opsm_mask` — off-policy sequence masking (DeepSeek-V3.2, slime's ``--use-opsm``);
* :func:`m2po_mask` — M2PO's second-moment constraint on the log-ratio (AReaL's
  ``m2_threshold``);
* :func:`top_entropy_mask` — the top-ρ quantile of tokens by entropy (TRL's
  ``top_entropy_quantile``);
* :func:`behavior_importance_weights` — AReaL's behaviour importance weight ``π_prox / π_behav``
  at token or sequence level, with sum / mean / max aggregation, clamped or masked.

**Invariance.** M2PO and the entropy quantile are batch-wide decisions: computed on each
micro-batch alone they change with the split (a token kept in one split is dropped in another).
Here they are computed over every action token of every rank of ``group`` (the data-parallel
group that shares the step), and the result on each rank is exactly the slice of the result of
one process holding the whole batch: the threshold is an order statistic found by a radix
select on the values' order-preserving integer keys, one byte per round (4 rounds for float32,
8 for float64). Each round every rank histograms its values in 256 bins by the next byte, and
one :func:`rlops.distributed.collectives.gather` of the ``[k, 256]`` bin counts (and sums)
adds them up; every rank then picks the same bin. No value is read on the host, no ``[N]``
tensor crosses ranks. With gradient accumulation in one process, call once on the whole step's
tokens (e.g. with the entropies recorded with the old log-probs) and slice the mask per
micro-batch, or apply the returned threshold (``metrics["entropy_threshold"]``,
``metrics["m2po_cut"]``) to each micro-batch.

Under context parallelism the token-level selections (M2PO, the entropy quantile) take the
DP×CP group as ``group``: every token of the step, wherever it is held.

OPSM and the behaviour weights are per row: the split of the batch into rows does not change
them; ``cp_group`` completes the row sums when the rows are split over context-parallel ranks
(one ``gather`` of ``[B, k]`` row summaries).

Everything is detached: the masks and weights change the measure, not the objective.
"""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_bool_mask,
    check_2d,
    check_bounds,
    check_choice,
    check_nonneg,
    check_positive,
    check_real,
    check_same_shape,
    compute_dtype,
)
from rlops._types import Group
from rlops.distributed.collectives import Call, fails_together, gather
from rlops.distributed.groups import group_rank_size
from rlops.rollout_correction import rollout_importance_weights

__all__ = [
    "BEHAVIOR_ACTIONS",
    "BEHAVIOR_AGGS",
    "BEHAVIOR_LEVELS",
    "behavior_importance_weights",
    "m2po_mask",
    "opsm_mask",
    "top_entropy_mask",
]

BEHAVIOR_LEVELS = ("token", "sequence")
BEHAVIOR_AGGS = ("sum", "mean", "max")
BEHAVIOR_ACTIONS = ("mask", "clamp")

_BINS = 256
_MAGNITUDE = {torch.float32: (1 << 31) - 1, torch.float64: (1 << 63) - 1}
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


# --------------------------------------------------------------------------- radix select
def _unsigned_key(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 keys of float32 / float64 ``x`` whose *unsigned* order is the float order, and the
    key width in bits (32 or 64). ``-0.0`` is taken as ``+0.0``; compare keys with
    :func:`_signed` (a 64-bit key's top bit is its sign bit flipped)."""
    bits = (x + 0.0).view(_INT[x.dtype]).to(torch.int64)
    signed = torch.where(bits < 0, bits ^ _MAGNITUDE[x.dtype], bits)
    if x.dtype == torch.float32:
        return signed + (1 << 31), 32
    return signed ^ (-(1 << 63)), 64


def _signed(u: torch.Tensor, width: int) -> torch.Tensor:
    """Keys of :func:`_unsigned_key` in the signed int64 order (for comparisons)."""
    return u - (1 << 31) if width == 32 else u ^ (-(1 << 63))


def _value(u: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The float of an unsigned key (the inverse of :func:`_unsigned_key`)."""
    k = _signed(u, width)
    bits = torch.where(k < 0, k ^ _MAGNITUDE[dtype], k)
    return bits.to(_INT[dtype]).view(dtype)


def _rounds(
    x: torch.Tensor,
    valid: torch.Tensor,
    weights: list[torch.Tensor],
    targets: int,
    group: Group,
    call: Call,
    choose,
) -> tuple[torch.Tensor, int]:
    """Radix select over the keys of the entries of ``x`` where ``valid`` (both flattened),
    over every rank of ``group``.

    Each round (one per key byte, from the top) histograms, per target, the valid values whose
    key starts with that target's bytes so far: a count and, per tensor of ``weights``, a sum
    (float64), ``[1 + len(weights), targets, 256]``, summed over the ranks by one
    :func:`gather`. ``choose(round, hist)`` returns the ``[targets]`` byte picked (the same on
    every rank, the histogram being the same). Returns the ``[targets]`` unsigned keys found
    and the key width. Invalid entries weigh 0 (no boolean indexing: no device sync)."""
    u, width = _unsigned_key(x.reshape(-1))
    on = valid.reshape(-1)
    prefix = torch.zeros(targets, dtype=torch.int64, device=x.device)
    cols = [
        on.to(torch.float64),
        *(torch.where(on, w.reshape(-1).to(torch.float64), 0.0) for w in weights),
    ]
    for r in range(width // 8):
        shift = width - 8 * (r + 1)
        digit = ((u >> shift) & (_BINS - 1)).expand(targets, -1)
        if r == 0:
            match = torch.ones(targets, u.numel(), dtype=torch.bool, device=x.device)
        else:
            match = (u >> (shift + 8))[None, :] == (prefix >> (shift + 8))[:, None]
        hist = torch.stack(
            [
                torch.zeros(targets, _BINS, dtype=torch.float64, device=x.device).scatter_add_(
                    1, digit, torch.where(match, c, 0.0)
                )
                for c in cols
            ]
        )
        hist = gather(hist, group, call.with_fields(round=r)).sum(0)
        prefix = prefix | (choose(r, hist) << shift)
    return prefix, width


# --------------------------------------------------------------------------- OPSM
@fails_together()
def opsm_mask(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta: float = 1e-4,
    cp_group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy sequence masking (OPSM): drop the negative-advantage tokens of rows that
    drifted too far from the policy that sampled them.

    DeepSeek-V3.2 (https://arxiv.org/abs/2512.02556, eq. 9): with ``A_b`` the action tokens of
    row ``b`` and ``KL_b = (1/|A_b|)·Σ_{t∈A_b} (old_logp − logp)`` (the sampling policy's
    log-probs minus the current ones; 0 for a row without action tokens)::

        keep[b, t] = mask[b, t] and not (advantages[b, t] < 0 and KL_b > delta)

    slime's ``compute_opsm_mask`` (``slime/utils/ppo_utils.py``) with a 0/1 ``loss_mask``.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy.
        old_logp: ``[B, T]`` log-probs under the policy that sampled them (rollout / old).
        advantages: ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` 0/1 action mask.
        delta: the KL threshold (slime's ``opsm_delta``, default 1e-4).
        cp_group: the context-parallel group whose ranks hold pieces of the same rows:
            ``KL_b`` over the whole row (one ``gather`` of ``[B, 2]`` row sums).

    Returns:
        ``(keep, metrics)``: ``keep`` ``[B, T]`` bool; ``metrics`` (detached 0-dim, this
        rank's tokens): ``opsm_masked_fraction`` (of action tokens), ``opsm_seq_fraction`` (of
        rows with an action token, rows over the threshold).

    Example:
        >>> import torch
        >>> logp = torch.tensor([[-2.0, -2.0], [-1.0, -1.0]])
        >>> old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])   # KL = 1 and 0
        >>> keep, m = opsm_mask(logp, old, torch.tensor([[-1.0, 1.0], [-1.0, -1.0]]),
        ...                     torch.ones(2, 2))
        >>> keep
        tensor([[False,  True],
                [ True,  True]])
    """
    check_2d("logp", logp)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages)
    keep = as_bool_mask("mask", mask, logp.shape, "logp", logp)
    delta = check_real("delta", delta)
    dtype = compute_dtype(torch.promote_types(logp.dtype, old_logp.dtype))
    d = torch.where(keep, old_logp.detach().to(dtype) - logp.detach().to(dtype), 0)
    rows = torch.stack([d.sum(-1).to(torch.float64), keep.sum(-1).to(torch.float64)], -1)
    if group_rank_size(cp_group, "cp_group")[1] > 1:
        rows = gather(rows, cp_group, Call("opsm_mask", delta=delta), "cp_group").sum(0)
    kl = rows[:, 0] / rows[:, 1].clamp_min(1)
    far = kl > delta
    dropped = keep & (advantages.detach() < 0) & far[:, None]
    n = keep.sum().to(dtype)
    has = rows[:, 1] > 0
    metrics = {
        "opsm_masked_fraction": dropped.sum().to(dtype) / n.clamp_min(1),
        "opsm_seq_fraction": (far & has).sum().to(dtype) / has.sum().to(dtype).clamp_min(1),
    }
    return keep & ~dropped, metrics


# --------------------------------------------------------------------------- M2PO
@fails_together()
def m2po_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO: drop the tokens of largest squared log-ratio until the batch's second moment is
    below ``threshold``, over the whole batch (every rank of ``group``).

    M2PO (https://arxiv.org/abs/2510.01161) bounds the second moment of the log-ratio between
    the trainer's (proximal) and the behaviour (rollout) policy,
    ``M2 = (1/|K|)·Σ_{t∈K} d_t²`` with ``d = old_logp − rollout_logp`` over the kept action
    tokens ``K``. AReaL's ``get_m2po_loss_mask`` sorts ``d²`` descending and masks the largest
    ones until the mean of the rest is ``< threshold`` (it keeps the smallest one if no such
    set exists). Here, with ``v`` ranging over the distinct values of ``d²`` and
    ``h(v) = Σ_{d_t² ≤ v} (d_t² − threshold)`` (ascending: ``h`` falls, then rises, so
    ``{v : h(v) < 0}`` is an initial run of values)::

        keep = mask and d² ≤ c,    c = the largest v with h(v) < 0   (every token if none rises
                                                                      back above 0)
        keep = mask and d² = min d²                                  if h(min d²) ≥ 0

    the largest set of smallest values whose mean is ``< threshold``: AReaL's set. **Ties** at
    the cut are all dropped (AReaL drops those its sort puts first), and all tokens tied at the
    minimum are kept in the fallback (AReaL keeps one), so the mask depends only on the values,
    never on their order or on how they are split over ranks and micro-batches.

    AReaL's names: its ``prox_logp`` is ``old_logp`` here, its ``old_logp`` (the inference
    engine's) is ``rollout_logp``. AReaL computes this per micro-batch, so its mask changes with
    the split; with ``group=`` the cut ``c`` is the one of the whole batch of every rank (radix
    select: 4 ``gather`` rounds of ``[2, 1, 256]`` in float32, 8 in float64; module docstring).

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer (proximal).
        rollout_logp: ``[B, T]`` log-probs of the same tokens under the behaviour policy.
        mask: ``[B, T]`` 0/1 action mask.
        threshold: ``> 0``, the bound on the batch's mean ``d²`` (AReaL's ``m2_threshold``).
        group: the data-parallel process group sharing the batch (None: this process only).

    Returns:
        ``(keep, metrics)``: ``keep`` ``[B, T]`` bool; ``metrics`` (detached 0-dim, over the
        whole batch): ``m2po_m2`` (mean ``d²`` of the action tokens), ``m2po_m2_kept`` (of the
        kept ones), ``m2po_masked_fraction``, ``m2po_cut``: the smallest dropped value (the
        first ``v`` with ``h(v) ≥ 0``): a token is kept when ``d² < m2po_cut``, or
        ``d² = m2po_cut`` when that is the smallest value; ``inf`` when nothing is dropped or
        there is no action token.

    Example:
        >>> import torch
        >>> d = torch.tensor([[0.1, -0.2, 0.9, 0.05]])
        >>> keep, m = m2po_mask(d, torch.zeros(1, 4), torch.ones(1, 4), threshold=0.04)
        >>> keep  # 0.81 dropped: the mean of 0.01, 0.04, 0.0025 is 0.0175 < 0.04
        tensor([[ True,  True, False,  True]])
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
    keep = as_bool_mask("mask", mask, old_logp.shape, "old_logp", old_logp)
    tau = check_positive("threshold", threshold)
    group_rank_size(group)
    dtype = compute_dtype(torch.promote_types(old_logp.dtype, rollout_logp.dtype))
    d = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    m2 = torch.where(keep, d.square(), 0)
    state: dict[str, torch.Tensor] = {}

    def choose(r: int, hist: torch.Tensor) -> torch.Tensor:
        count, g = hist[0, 0], hist[1, 0]
        if r == 0:
            state.update(
                n=count.sum(),
                total=g.sum(),
                below_n=count.new_zeros(()),
                below_g=count.new_zeros(()),
                found=torch.ones((), dtype=torch.bool, device=count.device),
            )
        c_end = state["below_n"] + count.cumsum(0)
        g_end = state["below_g"] + g.cumsum(0)
        rising = (g_end >= 0) & (c_end > 0)
        state["found"] = state["found"] & rising.any()
        digit = rising.to(torch.int8).argmax().reshape(1)  # the first bin where h rises to 0
        at_n = count.gather(0, digit)[0]
        state["below_n"] = c_end.gather(0, digit)[0] - at_n
        state["below_g"] = (g_end.gather(0, digit) - g.gather(0, digit))[0]
        state["at_n"] = at_n
        return digit.to(torch.int64)

    call = Call("m2po_mask", threshold=tau, dtype=dtype)
    prefix, width = _rounds(m2, keep, [m2 - tau], 1, group, call, choose)
    key = _signed(_unsigned_key(m2)[0], width)
    cut_key = _signed(prefix, width)[0]
    found, at_min = state["found"], state["below_n"] == 0
    chosen = torch.where(at_min, key == cut_key, key < cut_key)
    keep_out = keep & torch.where(found, chosen, True)
    n = state["n"]
    kept_n = torch.where(found, torch.where(at_min, state["at_n"], state["below_n"]), n)
    # Σ d² of the kept tokens from the same sums: below the cut h = Σ (d² − τ)
    at_value = _value(prefix, width, dtype)[0].to(torch.float64)
    kept_sum = torch.where(
        found,
        torch.where(at_min, state["at_n"] * at_value, state["below_g"] + tau * state["below_n"]),
        state["total"] + tau * n,
    )
    metrics = {
        "m2po_cut": torch.where(found & (n > 0), at_value, math.inf).to(dtype),
        "m2po_m2": ((state["total"] + tau * n) / n.clamp_min(1)).to(dtype),
        "m2po_m2_kept": (kept_sum / kept_n.clamp_min(1)).to(dtype),
        "m2po_masked_fraction": ((n - kept_n) / n.clamp_min(1)).to(dtype),
    }
    return keep_out, metrics


# --------------------------------------------------------------------------- entropy quantile
@fails_together()
def top_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    rho: float,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep the tokens whose entropy is in the top ``rho`` quantile of the whole batch.

    "Beyond the 80/20 rule" (https://arxiv.org/abs/2506.01939) trains on the high-entropy
    ("forking") tokens only. TRL's ``top_entropy_quantile = rho``
    (``GRPOTrainer.get_high_entropy_mask``) keeps, over the action tokens of every process::

        q    = torch.quantile(H[mask], 1 − rho)         linear interpolation between order
                                                        statistics: with n tokens, p = (n−1)(1−rho),
                                                        q = H_(⌊p⌋) + (p − ⌊p⌋)·(H_(⌈p⌉) − H_(⌊p⌋))
        keep = mask and H ≥ q

    computed here the same way (``p`` and the interpolation in the entropies' compute dtype,
    as ``torch.quantile`` on them). **Ties**: every token equal to ``q`` is kept, so more than
    ``rho·n`` tokens may be kept when entropies tie. ``rho = 1`` keeps every action token,
    ``rho = 0`` those tied with the largest entropy; a batch without action tokens keeps none.

    TRL gathers every process's entropies (``[N]`` each); here the two order statistics come
    from a radix select over ``group`` (4 ``gather`` rounds of ``[1, 2, 256]`` counts in
    float32, 8 in float64; module docstring), so the mask on each rank is the slice of the
    whole batch's, whatever the split.

    Args:
        entropy: ``[B, T]`` per-token entropies.
        mask: ``[B, T]`` 0/1 action mask.
        rho: in ``[0, 1]``, the fraction of the tokens to keep (TRL's ``top_entropy_quantile``;
            the paper uses 0.2).
        group: the data-parallel process group sharing the batch (None: this process only).

    Returns:
        ``(keep, metrics)``: ``keep`` ``[B, T]`` bool; ``metrics`` (detached 0-dim, over the
        whole batch): ``entropy_threshold`` (``q``; 0 without action tokens) and
        ``entropy_kept_fraction``.

    Example:
        >>> import torch
        >>> h = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        >>> m = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        >>> keep, _ = top_entropy_mask(h, m, rho=0.2)
        >>> keep.nonzero().tolist()   # the top 20 % of the 10 action tokens: 0.9 and 1.0
        [[1, 2], [1, 3]]
    """
    check_2d("entropy", entropy)
    keep = as_bool_mask("mask", mask, entropy.shape, "entropy", entropy)
    rho = check_nonneg("rho", rho)
    if rho > 1:
        raise ValueError(f"rho must be in [0, 1] (a fraction of the tokens), got {rho}")
    group_rank_size(group)
    dtype = compute_dtype(entropy.dtype)
    h = entropy.detach().to(dtype)
    level = 1.0 - rho
    state: dict[str, torch.Tensor] = {}

    def choose(r: int, hist: torch.Tensor) -> torch.Tensor:
        count = hist[0]  # [2, 256]
        if r == 0:
            n = count[0].sum()
            p = level * (n.to(dtype) - 1).clamp_min(0)
            lo = p.floor()
            state.update(
                n=n,
                frac=p - lo,
                rank=torch.stack([lo, p.ceil()]).to(torch.float64),
                below=count.new_zeros(2),
            )
        c_end = state["below"][:, None] + count.cumsum(-1)
        digit = (c_end <= state["rank"][:, None]).sum(-1).clamp_max(_BINS - 1)
        pick = digit[:, None]
        state["below"] = (c_end.gather(1, pick) - count.gather(1, pick))[:, 0]
        return digit

    call = Call("top_entropy_mask", rho=rho, dtype=dtype)
    prefix, width = _rounds(torch.where(keep, h, 0), keep, [], 2, group, call, choose)
    v_lo, v_hi = _value(prefix, width, dtype).unbind()
    q = torch.lerp(v_lo, v_hi, state["frac"].to(dtype))  # torch.quantile's interpolation
    n = state["n"]
    q = torch.where(n > 0, q, 0)
    keep_out = keep & (h >= q) & (n > 0)
    # tokens >= q: all but those below v_lo (q == v_lo) or below v_hi (q > v_lo)
    below = torch.where(q > v_lo, state["below"][1], state["below"][0])
    metrics = {
        "entropy_kept_fraction": ((n - below) / n.clamp_min(1)).to(dtype),
        "entropy_threshold": q,
    }
    return keep_out, metrics


# --------------------------------------------------------------------------- behaviour weights
@fails_together()
def behavior_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    upper: float,
    lower: float | None = None,
    level: str = "token",
    agg: str = "mean",
    action: str = "mask",
    group: Group = None,
    cp_group: Group = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's behaviour importance weight ``π_prox / π_behav``, rejected or clamped at token
    or sequence level, the sequence's ratio aggregated by sum, mean or max.

    AReaL's ``apply_rejection_sampling`` with ``metric="ratio"``
    (``areal/utils/functional/functional.py``): with ``d = old_logp − rollout_logp`` (AReaL's
    ``proximal_logprobs − old_logprobs``) on action tokens, ``A_b`` the row's action tokens::

        token level      statistic ρ_t = exp(d_t)                 weight w_t = ρ_t
        sequence level   statistic, by agg:                       weight w_t = exp(mean_{A_b} d)
                           sum   exp(Σ_{A_b} d)                     (the geometric mean, for
                           mean  exp(mean_{A_b} d)                   every agg)
                           max   exp(max_{A_b} d)

    A statistic is in bounds when ``lower ≤ s ≤ upper`` (``lower=None``: ``s ≤ upper``).
    ``action="mask"`` drops the out-of-bounds token (the whole row at sequence level) from the
    keep mask, its weight 0; ``action="clamp"`` keeps it with the weight clamped to
    ``[lower or 0, upper]``.

    Built on :func:`rlops.rollout_importance_weights`: token level, and sequence level with sum
    or mean, are its ``level="token"`` / ``"sequence"`` / ``"geometric"`` with
    ``mode="mask" | "truncate"``; the max aggregation (the row's largest token ratio) is added
    here, with ``cp_group`` over the whole row (one ``gather`` of ``[B, 1]``). Collectives:
    over ``cp_group`` one ``gather`` of row summaries at token level or with ``mean``, two with
    ``sum`` or ``max``; over ``group`` one for the metrics. Bounds are
    compared in log space (``d ≤ log upper``), equal to AReaL's comparison of ``exp(d)`` up to
    the rounding of ``exp``; weights saturate at ``e^20``. AReaL maps a non-finite log-ratio to
    0; here a NaN log-prob is out of bounds (mask) or gives a NaN weight (clamp), as in
    :func:`rlops.rollout_importance_weights`.

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer (AReaL's
            ``proximal_logprobs``); a constant (detached).
        rollout_logp: ``[B, T]`` log-probs under the behaviour policy that sampled them
            (AReaL's ``old_logprobs``, from the inference engine); a constant (detached).
        mask: ``[B, T]`` 0/1 action mask.
        upper: ``> 0``, the upper bound of the statistic (AReaL's ``upper``).
        lower: in ``(0, upper]`` or None (AReaL's ``lower``).
        level: ``"token"`` or ``"sequence"``.
        agg: at sequence level, ``"sum"``, ``"mean"`` or ``"max"`` (AReaL's ``agg``).
        action: ``"mask"`` (rejection) or ``"clamp"`` (truncation).
        group: a process group: metrics over every rank's action tokens.
        cp_group: the context-parallel group whose ranks hold pieces of the same rows.

    Returns:
        ``(weights, keep, metrics)``: ``weights`` ``[B, T]`` detached, 0 off ``keep``;
        ``keep`` ``[B, T]`` bool (``mask`` less the rejected tokens; ``mask`` with clamp);
        ``metrics``: ``behave_filtered_fraction`` (AReaL's ``filtered_fraction``: of the
        action tokens, those dropped, or with clamp those whose weight was clamped),
        ``behave_imp_weight_mean`` (over the kept tokens; 0 when none is kept).

    Example:
        >>> import torch
        >>> old = torch.zeros(2, 3)
        >>> rollout = torch.tensor([[0.0, 0.0, -1.0], [0.1, -0.1, 0.0]])
        >>> w, keep, m = behavior_importance_weights(old, rollout, torch.ones(2, 3), upper=2.0,
        ...                                          level="sequence", agg="max")
        >>> keep[:, 0], w[:, 0]   # row 0's largest ratio is e > 2: rejected
        (tensor([False,  True]), tensor([0., 1.]))
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
    base = as_bool_mask("mask", mask, old_logp.shape, "old_logp", old_logp)
    low, up = check_bounds("upper", upper, "lower", lower)
    level = check_choice("level", level, BEHAVIOR_LEVELS)
    agg = check_choice("agg", agg, BEHAVIOR_AGGS)
    action = check_choice("action", action, BEHAVIOR_ACTIONS)
    mode = "mask" if action == "mask" else "truncate"

    def weights(lvl: str, how: str, high: float, bottom: float | None = None):
        return rollout_importance_weights(
            old_logp,
            rollout_logp,
            mask,
            level=lvl,
            mode=how,
            threshold=high,
            low=bottom,
            cp_group=cp_group,
        )

    if level == "token" or agg == "mean":
        lvl = "token" if level == "token" else "geometric"
        w, keep, m = weights(lvl, mode, up, low)
        if action == "clamp":  # the clamped tokens: those whose statistic is out of bounds
            out = m["rollout_is_ratio_fraction_high"] + m["rollout_is_ratio_fraction_low"]
            n_changed = out.to(torch.float64) * base.sum()
        else:
            n_changed = (base & ~keep).sum()
    else:
        raw, _, _ = weights("geometric", "truncate", math.inf)
        if agg == "sum":
            _, inside, _ = weights("sequence", "mask", up, low)
            inside_row = inside.any(-1)
        else:
            inside_row = _row_max_in_bounds(old_logp, rollout_logp, base, low, up, cp_group)
        inside = base & inside_row[:, None]
        if action == "mask":
            keep, w = inside, torch.where(inside, raw, 0)
        else:
            keep = base
            w = torch.where(inside, raw, raw.clamp(0.0 if low is None else low, up))
            w = torch.where(base, w, 0)
        n_changed = (base & ((w != raw) if action == "clamp" else ~keep)).sum()
    dtype = w.dtype
    sums = torch.stack([base.sum(), n_changed, keep.sum()]).to(torch.float64)
    sums = torch.cat([sums, w.to(torch.float64).sum().reshape(1)])
    if group is not None:
        call = Call(
            "behavior_importance_weights", level=level, agg=agg, action=action, upper=up, lower=low
        )
        sums = gather(sums, group, call).sum(0)
    metrics = {
        "behave_filtered_fraction": (sums[1] / sums[0].clamp_min(1)).to(dtype),
        "behave_imp_weight_mean": (sums[3] / sums[2].clamp_min(1)).to(dtype),
    }
    return w, keep, metrics


def _row_max_in_bounds(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    keep: torch.Tensor,
    low: float | None,
    up: float,
    cp_group: Group,
) -> torch.Tensor:
    """``[B]``: whether ``log lower ≤ max_{A_b} d ≤ log upper`` (a row without action tokens
    is in bounds, as AReaL); the maximum over every rank of ``cp_group``."""
    dtype = compute_dtype(torch.promote_types(old_logp.dtype, rollout_logp.dtype))
    d = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    if d.shape[-1] == 0:
        top = d.new_full(d.shape[:-1], -math.inf)
    else:
        top = torch.where(keep, d, -math.inf).amax(-1)
    if group_rank_size(cp_group, "cp_group")[1] > 1:
        call = Call("behavior_importance_weights", agg="max", upper=up, lower=low)
        top = gather(top[:, None], cp_group, call, "cp_group").amax(0)[:, 0].to(dtype)
    lo = -math.inf if low is None else math.log(low)
    empty = top == -math.inf
    return empty | ((top >= lo) & (top <= math.log(up)))
