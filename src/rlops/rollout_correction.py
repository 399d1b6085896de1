"""Rollout-training mismatch correction: importance weights, rejection masks and diagnostics.

The rollout engine (vLLM, SGLang) and the trainer (FSDP, Megatron) score the same sampled
tokens with slightly different numbers (kernels, precision, a stale checkpoint). With the
trainer's old log-probs ``old_logp`` and the engine's ``rollout_logp`` over the same tokens,
the per-token log-ratio is::

    d[b, t] = old_logp[b, t] − rollout_logp[b, t] = log(π_train / π_rollout)

on action tokens (``mask`` = 1; multi-turn masks may leave tool and observation spans inside
a row, and sequence quantities are over the row's action tokens only). From ``d``:

* :func:`rollout_importance_weights` — importance weights at token, sequence or geometric
  level, truncated (TIS) or masked (MIS / IcePop), optionally normalised to mean 1;
* :func:`rollout_rejection_mask` — a keep mask from token or sequence statistics of ``d``
  (k1, k2, k3 divergences; sum, mean or max over the row), several criteria combined;
* :func:`rollout_mismatch_metrics` — KL (k1, k3), χ² and log-perplexity gap between the two
  policies.

Names and meanings follow verl's rollout correction (``rollout_is``, ``rollout_rs``, their
metric names). TIS: https://fengyao.notion.site/off-policy-rl — the mismatch, masking over
clipping and geometric-level rejection: https://richardli.xyz/rl-collapse and
https://arxiv.org/abs/2512.23075 — IcePop (masking outside [low, high]) is Ring-1T's.

Numerical rules:

* Everything stays in log space until the last ``exp``, whose argument is clamped to at most
  ``MAX_EXP_ARG = 20`` (:mod:`rlops._numerics`: ``e^20 ≈ 4.9e8``; ``e^40`` for squared
  weights, both finite in float32): a 32K-token row whose every log-ratio is 0.01 (a sequence
  log-weight of 327) gives a finite weight, truncated or masked by rule, and finite
  diagnostics. Thresholds are compared
  with the log-weight, before the clamp, so the decision does not depend on it.
* ``χ² = E[ρ²] − 1`` is summed as ``expm1(2·log ρ)`` and ``k3 = ρ − 1 − log ρ`` as
  ``expm1(log ρ) − log ρ``: equal log-probs give exactly 0, not a difference of rounded ones.
* Half-precision inputs are computed in float32; weights and metrics are returned in the
  computation dtype (float32 for half inputs). Entries with mask 0 are replaced before any
  arithmetic, so NaN/inf padding reaches nothing.
* Everything is detached (weights change the measure, not the objective): ``old_logp`` and
  ``rollout_logp`` stand for fixed policies and are detached where they are received. Metrics
  are 0-dim tensors; nothing reads a value back to the host. With ``group=`` (the
  data-parallel ranks that share a batch) every batch-wide quantity of a call — the
  normaliser and every metric — comes from one ``all_gather`` of a few float64 numbers per
  rank; every rank must call, ranks with no action token included. A batch (or group) with no
  action token gives metrics 0 (``rollout_is_batch_norm_factor`` 1).
* Context parallelism: where each row is split over the ranks of ``cp_group`` (any split:
  ``cp_layout="zigzag"``, Megatron's, or ``"contiguous"``), sequence quantities (sequence and
  geometric weights, ``seq_*`` rejection, ``chi2_seq``, ``log_ppl_diff``) are over the whole
  row: each rank sends ``[B, k]`` row summaries (action count, sum of ``d``, the sums and
  maxima that rejection needs) in one ``all_gather`` over ``cp_group``
  (:class:`rlops.distributed.rows.Rows`, which the losses use too); then ``group=`` must be
  the DP×CP group (checked to contain ``cp_group``), and row-level metrics are counted by CP
  rank 0. Without ``group`` the metrics are the whole rows', reduced over ``cp_group`` in a
  second collective. Without ``cp_group`` each rank must hold whole rows.
* Packed rows (``seq_ids``, ``seqs_per_row``): every sequence quantity is per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlops._checks import (
    as_bool_mask,
    as_real,
    check_2d,
    check_bool,
    check_bounds,
    check_choice,
    check_positive,
    check_same_shape,
    compute_dtype,
)
from rlops._numerics import MAX_EXP_ARG
from rlops._types import CPLayout, Group
from rlops.distributed.collectives import Call, fails_together, gather
from rlops.distributed.rows import Rows

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "RS_OPTIONS",
    "rollout_importance_weights",
    "rollout_mismatch_metrics",
    "rollout_rejection_mask",
]

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip


# --------------------------------------------------------------------------- helpers
class _Batch:
    """Validated inputs: the masked log-ratio ``d`` (0 off the mask) in the computation dtype,
    the bool mask and its :class:`Rows` (``rowset``); after :meth:`gather_rows`, per-row
    (per-sequence) action counts and sums of ``d`` over whole rows (over every rank of
    ``cp_group``), each ``[B, K]`` (``K = 1`` unless the rows are packed)."""

    def __init__(
        self,
        old_logp: torch.Tensor,
        rollout_logp: torch.Tensor,
        mask: torch.Tensor,
        cp_group: Group,
        cp_layout: CPLayout,
        seq_ids: object,
        seqs_per_row: object,
        group: Group,
    ) -> None:
        check_2d("old_logp", old_logp)
        check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
        self.keep = as_bool_mask("mask", mask, old_logp.shape, "old_logp", old_logp)
        self.dtype = compute_dtype(torch.promote_types(old_logp.dtype, rollout_logp.dtype))
        self.rowset = Rows(
            self.keep,
            self.dtype,
            cp_group=cp_group,
            cp_layout=cp_layout,
            seq_ids=seq_ids,
            seqs_per_row=seqs_per_row,
            group=group,
        )
        self.cp_group, self.group = cp_group, group
        diff = old_logp.detach().to(self.dtype) - rollout_logp.detach().to(self.dtype)
        self.d = torch.where(self.keep, diff, 0)

    def describe(self, op: str, **fields: object) -> Call:
        """What every rank of ``group`` and ``cp_group`` must agree on for this call."""
        self.call = Call(
            op,
            implied=None,
            **fields,
            **{"cp_group size": self.rowset.cp_world, **self.rowset.fields()},
        )
        self.rowset.call = self.call
        return self.call

    def gather_rows(
        self, sums: tuple[torch.Tensor, ...] = (), maxes: tuple[torch.Tensor, ...] = ()
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Set the whole rows' action counts and sums of ``d`` and return the whole rows'
        sums of ``sums`` and maxima of ``maxes`` (per-token ``[B, T]``, 0 off the mask; each
        returned ``[B, K]``): local, or under context parallelism from one collective of
        ``[B, k]`` float64 per rank of ``cp_group`` (:meth:`Rows.reduce`). Row-level metrics
        are then counted by CP rank 0 only (``rows_here``)."""
        got, row_maxes, _ = self.rowset.reduce((self.d, *sums), maxes)
        self.row_count, self.row_sum = self.rowset.count, got[0]
        self.rows = self.rowset.nonempty
        self.rows_here = self.rowset.counted
        return got[1:], row_maxes

    def row_mean(self, x_rows: torch.Tensor) -> torch.Tensor:
        return x_rows / self.row_count.clamp_min(1)

    def per_token(self, x_rows: torch.Tensor) -> torch.Tensor:
        return self.rowset.per_token(x_rows)

    def reduce(self, t: _Tally) -> dict[str, torch.Tensor]:
        """The batch-wide totals of ``t`` over ``group``, else (the whole rows' metrics) over
        ``cp_group``, in one collective; local without either."""
        if self.group is None and self.rowset.cp:
            return t.reduce(self.cp_group, self.call, "cp_group")
        return t.reduce(self.group, self.call)


def _k3(d: torch.Tensor) -> torch.Tensor:
    """``ρ − 1 − log ρ = expm1(d) − d`` (≥ 0), ``d`` clamped to at most ``MAX_EXP_ARG``
    (beyond it the value saturates at ``e^20 − 21``; for ``d → −∞`` it is exact)."""
    dc = d.clamp_max(MAX_EXP_ARG)
    return (torch.expm1(dc) - dc).clamp_min(0)


def _sum(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    return torch.where(where, x, 0).sum()


def _max(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Largest selected entry; ``-inf`` when none (also for an empty tensor)."""
    if x.numel() == 0:
        return x.new_full((), -math.inf)
    return torch.where(where, x, -math.inf).amax()


class _Tally:
    """Batch-wide sums and maxima, reduced over ``group`` in one collective.

    ``add(name, value)`` registers a local sum, ``add_max`` a local maximum (``add_max(name,
    −x)`` for a minimum). :meth:`reduce` returns every value over all ranks, in the
    computation dtype, detached.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value

    def add_max(self, name: str, value: torch.Tensor) -> None:
        self.maxes[name] = value

    def reduce(self, group: Group, call: Call, name: str = "group") -> dict[str, torch.Tensor]:
        """Sums and maxima over every rank of ``group``, from one
        :func:`rlops.distributed.collectives.gather` (which checks that every rank makes the
        same ``call``)."""
        names = [*self.sums, *self.maxes]
        local = torch.stack(
            [v.to(torch.float64) for v in (*self.sums.values(), *self.maxes.values())]
        )
        if group is not None:
            gathered = gather(local, group, call, name)
            n = len(self.sums)
            local = torch.cat([gathered[:, :n].sum(0), gathered[:, n:].amax(0)])
        return {k: v.to(self.dtype) for k, v in zip(names, local.unbind(), strict=True)}


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, 0 where ``den`` is 0."""
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), 0)


def _extreme(value: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A reduced maximum, 0 when nothing was selected (``±inf`` sentinel)."""
    return torch.where(count > 0, value, 0)


def _tally_mismatch(t: _Tally, b: _Batch) -> None:
    """Local sums behind :func:`rollout_mismatch_metrics`."""
    t.add("tokens", b.keep.sum())
    t.add("rows", b.rows_here.sum())
    t.add("k1", -b.d.sum())
    t.add("k3", _sum(_k3(b.d), b.keep))
    t.add("chi2_token", _sum(torch.expm1(2 * b.d.clamp_max(MAX_EXP_ARG)), b.keep))
    t.add("chi2_seq", _sum(torch.expm1(2 * b.row_sum.clamp_max(MAX_EXP_ARG)), b.rows_here))
    t.add("log_ppl_diff", _sum(-b.row_mean(b.row_sum), b.rows_here))


def _mismatch(r: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens, rows = r["tokens"], r["rows"]
    return {
        "chi2_seq": _ratio(r["chi2_seq"], rows),
        "chi2_token": _ratio(r["chi2_token"], tokens),
        "k3_kl": _ratio(r["k3"], tokens),
        "kl": _ratio(r["k1"], tokens),
        "log_ppl_diff": _ratio(r["log_ppl_diff"], rows),
    }


# --------------------------------------------------------------------------- diagnostics
@fails_together()
def rollout_mismatch_metrics(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: Group = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
    seq_ids: torch.Tensor | None = None,
    seqs_per_row: int | None = None,
) -> dict[str, torch.Tensor]:
    """How far the rollout policy is from the trainer's, over the action tokens of a batch.

    With ``d = old_logp − rollout_logp = log ρ`` on action tokens, ``N`` of them, ``S_b`` the
    sum of ``d`` over row ``b``'s action tokens and ``n_b`` their count (rows with ``n_b > 0``
    only, ``R`` of them)::

        kl           = Σ −d / N                      k1 estimate of KL(π_rollout ‖ π_train)
        k3_kl        = Σ (ρ − 1 − log ρ) / N         k3 estimate of the same KL (≥ 0)
        chi2_token   = Σ (ρ² − 1) / N                χ²(π_train ‖ π_rollout) per token
        chi2_seq     = Σ_b (exp(2·S_b) − 1) / R      χ² of the sequence ratio Π ρ
        log_ppl_diff = Σ_b (−S_b / n_b) / R          log PPL_train − log PPL_rollout, per row

    (verl's ``compute_offpolicy_metrics`` names). ``ρ − 1 − log ρ`` and ``ρ² − 1`` are computed
    with ``expm1`` and ``log ρ`` clamped to at most 20, so ``d = 50`` or a 32K-token row stays
    finite; equal inputs give exactly 0 for every metric.

    Over context-parallel rows (``cp_group``, ``cp_layout``) the sequence metrics
    (``chi2_seq``, ``log_ppl_diff``) are the whole rows'; packed rows (``seq_ids``,
    ``seqs_per_row``) make them per sequence; both as in :func:`rollout_importance_weights`.

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer.
        rollout_logp: ``[B, T]`` log-probs of the same tokens from the rollout engine.
        mask: ``[B, T]`` 0/1 action mask.
        group: a process group: metrics over every rank's action tokens (one ``all_gather``).

    Returns:
        dict of detached 0-dim tensors (computation dtype): ``chi2_seq``, ``chi2_token``,
        ``k3_kl``, ``kl``, ``log_ppl_diff``.

    Example:
        >>> import torch
        >>> old = torch.tensor([[-1.0, -2.0, -0.5]])
        >>> m = rollout_mismatch_metrics(old, old - torch.tensor([[0.25, -0.5, 0.0]]),
        ...                              torch.tensor([[1, 1, 0]]))
        >>> m["kl"], m["k3_kl"], m["chi2_token"]
        (tensor(0.1250), tensor(0.0703), tensor(0.0083))
    """
    b = _Batch(old_logp, rollout_logp, mask, cp_group, cp_layout, seq_ids, seqs_per_row, group)
    b.describe("rollout_mismatch_metrics")
    b.gather_rows()
    t = _Tally(b.dtype)
    _tally_mismatch(t, b)
    return _mismatch(b.reduce(t))


# --------------------------------------------------------------------------- importance weights
def _log_bounds(name: str, value: object, low_name: str, low: object) -> tuple[float, float]:
    """``(log low, log high)`` of ratio bounds ``0 < low <= high`` (``low=None``: no bound)."""
    lo, hi = check_bounds(name, value, low_name, low)
    return (-math.inf if lo is None else math.log(lo)), math.log(hi)


@fails_together()
def rollout_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    low: float | None = None,
    batch_normalize: bool = False,
    group: Group = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
    seq_ids: torch.Tensor | None = None,
    seqs_per_row: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ``π_train / π_rollout`` that correct a loss for the rollout mismatch.

    With ``d = old_logp − rollout_logp`` on action tokens, the log-weight ``ℓ`` of token
    ``(b, t)`` is, by ``level``::

        token       ℓ[b, t] = d[b, t]                       ρ_t
        sequence    ℓ[b, t] = S_b = Σ_{t ∈ A_b} d[b, t]      Π ρ_t over the row's action tokens A_b
        geometric   ℓ[b, t] = S_b / |A_b|                    (Π ρ_t)^(1/|A_b|)

    and with ``[L, H] = [log low, log threshold]`` (``L = −∞`` for ``low=None``), by ``mode``::

        truncate    w = exp(clamp(ℓ, L, min(H, 20)))        TIS: min(ρ, threshold), or clamp
        mask        w = exp(min(ℓ, 20)) if L ≤ ℓ ≤ H else 0  MIS / IcePop: the token (row) dropped

    (``ℓ = NaN``, from a NaN log-prob, is not in ``[L, H]``: ``mask`` mode drops it; in
    ``truncate`` mode its weight is NaN.)

    ``mask`` mode also drops the token (every action token of the row, at sequence and
    geometric level) from the returned ``keep_mask``. Thresholds are compared with ``ℓ`` in log
    space, before any clamp. With ``batch_normalize`` the weights are divided by their mean
    over the batch's action tokens (dropped tokens count as 0, as verl's), over every rank of
    ``group``: the kept weights then average to 1 per action token; a mean of 0 leaves them
    as they are.

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer (before the
            update: verl's ``old_log_prob``); a constant (detached inside).
        rollout_logp: ``[B, T]`` log-probs of the same tokens from the rollout engine; a
            constant (detached inside).
        mask: ``[B, T]`` 0/1 action mask (``response_mask``; may hold multi-turn spans).
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        mode: ``"truncate"`` or ``"mask"``.
        threshold: upper ratio bound ``> 0`` (``inf``: none; weights still saturate at
            ``e^20``).
        low: lower ratio bound in ``(0, threshold]``, or ``None`` (no lower bound).
        batch_normalize: normalise the weights to mean 1 over the action tokens.
        group: a process group (DP, or DP×CP with ``cp_group``): normaliser and metrics over
            every rank's action tokens, from one ``all_gather``.
        cp_group: the context-parallel group whose ranks hold pieces of the same rows:
            sequence quantities over the whole row (one more ``all_gather``, of ``[B, k]``);
            without ``group``, the metrics are the whole rows' (over ``cp_group``).
        cp_layout: ``"zigzag"`` or ``"contiguous"``: how rows are split over ``cp_group``
            (row sums and maxima need no order; checked and compared across ranks).
        seq_ids: packed rows: ``[B, T]`` integer sequence ids in ``[0, seqs_per_row)``;
            every sequence quantity is then per sequence (see :func:`rlops.aggregate_loss`).
        seqs_per_row: with ``seq_ids``, the number of sequence slots per row.

    Returns:
        ``(weights, keep_mask, metrics)``: ``weights`` ``[B, T]`` detached, 0 off ``keep_mask``
        (computation dtype: float32 for half inputs); ``keep_mask`` ``[B, T]`` bool, ``mask``
        less the dropped tokens (equal to ``mask`` in truncate mode); ``metrics``, detached
        0-dim tensors over the action tokens of ``mask`` (verl's names):
        ``rollout_is_mean`` / ``_min`` / ``_max`` (the weights before normalisation),
        ``rollout_is_eff_sample_size`` (ESS / n = (Σw)² / (n·Σw²), 1 for equal weights, 0 when
        every weight is 0), ``rollout_is_ratio_fraction_high`` / ``_low`` (fraction of action
        tokens with ``ℓ > H`` / ``ℓ < L``: truncated or dropped), ``rollout_is_batch_norm_factor``
        (the mean divided by; 1 when off), and those of :func:`rollout_mismatch_metrics`.

    Example:
        >>> import torch
        >>> old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
        >>> rollout = torch.tensor([[-1.5, -1.0, -0.8], [-2.0, -0.5, -1.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        >>> w, keep, m = rollout_importance_weights(old, rollout, mask, threshold=1.5)
        >>> w
        tensor([[1.5000, 1.0000, 0.8187],
                [1.5000, 0.6065, 0.0000]])
        >>> m["rollout_is_ratio_fraction_high"]
        tensor(0.4000)
        >>> w, keep, m = rollout_importance_weights(old, rollout, mask, level="sequence",
        ...                                         mode="mask", threshold=1.5, low=0.5)
        >>> keep
        tensor([[ True,  True,  True],
                [False, False, False]])
        >>> w[:, 0]
        tensor([1.3499, 0.0000])
    """
    b = _Batch(old_logp, rollout_logp, mask, cp_group, cp_layout, seq_ids, seqs_per_row, group)
    level = check_choice("level", level, IS_LEVELS)
    mode = check_choice("mode", mode, IS_MODES)
    low, threshold = check_bounds("threshold", threshold, "low", low)
    lo, hi = (-math.inf if low is None else math.log(low)), math.log(threshold)
    check_bool("batch_normalize", batch_normalize)
    b.describe(
        "rollout_importance_weights",
        level=level,
        mode=mode,
        threshold=threshold,
        low=low,
        batch_normalize=batch_normalize,
    )

    b.gather_rows()
    if level == "token":
        lw = b.d
    else:
        row = b.row_sum if level == "sequence" else b.row_mean(b.row_sum)
        lw = b.per_token(row)
    above, below = b.keep & (lw > hi), b.keep & (lw < lo)
    if mode == "truncate":
        keep = b.keep
        w = torch.exp(lw.clamp(lo, min(hi, MAX_EXP_ARG)))
    else:
        # inside [L, H]: a NaN log-weight (a NaN log-prob) is outside, so it is dropped too
        keep = b.keep & (lw >= lo) & (lw <= hi)
        w = torch.exp(lw.clamp_max(MAX_EXP_ARG))
    w = torch.where(keep, w, 0)

    t = _Tally(b.dtype)
    t.add("w", w.sum())
    t.add("w2", w.square().sum())
    t.add("high", above.sum())
    t.add("low", below.sum())
    t.add_max("max", _max(w, b.keep))
    t.add_max("neg_min", _max(-w, b.keep))
    _tally_mismatch(t, b)
    r = b.reduce(t)

    n = r["tokens"]
    mean = _ratio(r["w"], n)
    metrics = {
        "rollout_is_batch_norm_factor": torch.ones_like(mean),
        "rollout_is_eff_sample_size": _ratio(mean.square(), _ratio(r["w2"], n)),
        "rollout_is_max": _extreme(r["max"], n),
        "rollout_is_mean": mean,
        "rollout_is_min": _extreme(-r["neg_min"], n),
        "rollout_is_ratio_fraction_high": _ratio(r["high"], n),
        "rollout_is_ratio_fraction_low": _ratio(r["low"], n),
        **_mismatch(r),
    }
    if batch_normalize:
        factor = torch.where(mean > 0, mean, 1)
        w = w / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return w, keep, {k: metrics[k] for k in sorted(metrics)}


# --------------------------------------------------------------------------- rejection
def _rs_bounds(option: str, spec: object) -> tuple[float, float]:
    """Bounds ``(low, high)`` of the statistic for one rejection option.

    k1 options take ratio bounds ``(lower, upper)`` or one ``upper`` (``lower = 1/upper``),
    compared with the statistic in log space; k2 / k3 options take one upper bound ``> 0``.
    """
    name = f"criteria[{option!r}]"
    if option.endswith("k1"):
        if isinstance(spec, tuple | list):
            if len(spec) != 2:
                raise ValueError(f"{name} must be (lower, upper) or one upper bound, got {spec}")
            return _log_bounds(f"{name} upper", spec[1], f"{name} lower", spec[0])
        upper = check_positive(name, spec)
        return _log_bounds(name, upper, f"{name} lower (1/upper)", 1.0 / upper)
    if isinstance(spec, tuple | list):
        raise TypeError(f"{name} must be one upper bound (a number) for {option}, got {spec!r}")
    return -math.inf, check_positive(name, spec)


def _as_given(option: str, spec: object) -> float | tuple[float, ...]:
    """One option's threshold(s) as given (numbers as floats), for :class:`Call`."""
    return (
        tuple(as_real(option, v) for v in spec)
        if isinstance(spec, tuple | list)
        else (as_real(option, spec))
    )


@fails_together()
def rollout_rejection_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    criteria: Mapping[str, float | tuple[float, float]],
    *,
    group: Group = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
    seq_ids: torch.Tensor | None = None,
    seqs_per_row: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reject tokens or whole rows whose rollout log-probs disagree too much with the trainer's.

    With ``d = old_logp − rollout_logp = log ρ`` on action tokens, the per-token divergences
    of π_train from π_rollout (samples from π_rollout) are::

        k1 = −d          k2 = d² / 2          k3 = ρ − 1 − log ρ = expm1(d) − d   (d ≤ 20)

    A criterion ``"token_kX"`` tests each token's ``kX``; ``"seq_sum_kX"``, ``"seq_mean_kX"``
    and ``"seq_max_kX"`` test the sum, mean or max of ``kX`` over the row's action tokens and
    keep or drop the whole row. k2 / k3 statistics must be ``<= upper``; a k1 statistic must lie
    in ``[log lower, log upper]``: bounds on ``exp(k1)`` = π_rollout / π_train (of the token,
    of the row for sums, geometric per token for means). Every criterion must pass
    (verl's ``rollout_rs`` options, combined with "and").

    Over context-parallel rows (``cp_group``, ``cp_layout``) the row criteria (``seq_*``)
    test the whole rows; packed rows (``seq_ids``, ``seqs_per_row``) make them per sequence;
    both as in :func:`rollout_importance_weights`.

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer.
        rollout_logp: ``[B, T]`` log-probs of the same tokens from the rollout engine.
        mask: ``[B, T]`` 0/1 action mask.
        criteria: option name (one of :data:`RS_OPTIONS`) -> threshold: ``upper > 0`` for k2
            and k3; ``(lower, upper)`` with ``0 < lower <= upper``, or one ``upper``
            (``lower = 1/upper``), for k1. At least one.
        group: a process group: metrics over every rank's action tokens (one ``all_gather``);
            the mask itself needs no communication.

    Returns:
        ``(keep_mask, metrics)``: ``keep_mask`` ``[B, T]`` bool, ``mask`` less the rejected
        tokens; ``metrics``, detached 0-dim tensors: ``rollout_rs_masked_fraction`` (of
        action tokens), ``rollout_rs_seq_masked_fraction`` (of rows with an action token, rows
        that lost at least one), and per option ``rollout_rs_<option>_masked_fraction`` and
        the statistic's ``_mean`` / ``_min`` / ``_max`` (over action tokens for token
        options, over rows with an action token for row options; 0 when there are none).

    Example:
        >>> import torch
        >>> old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
        >>> rollout = torch.tensor([[-1.5, -1.0, -0.8], [-3.0, -0.5, -1.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        >>> keep, m = rollout_rejection_mask(old, rollout, mask, {"seq_max_k2": 1.0})
        >>> keep
        tensor([[ True,  True,  True],
                [False, False, False]])
        >>> m["rollout_rs_masked_fraction"]
        tensor(0.4000)
    """
    b = _Batch(old_logp, rollout_logp, mask, cp_group, cp_layout, seq_ids, seqs_per_row, group)
    if not isinstance(criteria, Mapping) or not criteria:
        raise ValueError(
            "criteria must be a non-empty mapping of rejection option -> threshold, e.g. "
            f"{{'seq_mean_k3': 0.01}}; got {criteria!r}"
        )
    for option in criteria:
        check_choice("criteria option", option, RS_OPTIONS)
    # in one order whatever the mapping's (every rank then sends its sums in the same order)
    bounds = {o: _rs_bounds(o, criteria[o]) for o in RS_OPTIONS if o in criteria}
    given = tuple((o, _as_given(o, criteria[o])) for o in bounds)
    b.describe("rollout_rejection_mask", criteria=given)

    token_stats = {
        "k1": -b.d,
        "k2": 0.5 * b.d.square(),
        "k3": torch.where(b.keep, _k3(b.d), 0),
    }
    # token criteria are local; row criteria need whole rows: one gather of row summaries
    token_passed = b.keep
    for option, (lo, hi) in bounds.items():
        if option.startswith("token"):
            x = token_stats[option[-2:]]
            token_passed = token_passed & (x >= lo) & (x <= hi)
    row_options = [o for o in bounds if not o.startswith("token")]
    row_sums, row_maxes = b.gather_rows(
        tuple(token_stats[o[-2:]] for o in row_options if not o.startswith("seq_max")),
        (
            *(token_stats[o[-2:]] for o in row_options if o.startswith("seq_max")),
            (b.keep & ~token_passed).to(b.dtype),
        ),
    )
    row_stats = dict(
        zip([o for o in row_options if not o.startswith("seq_max")], row_sums, strict=True)
    )
    row_stats.update(
        zip([o for o in row_options if o.startswith("seq_max")], row_maxes[:-1], strict=True)
    )
    t = _Tally(b.dtype)
    keep = b.keep
    t.add("tokens", b.keep.sum())
    t.add("rows", b.rows_here.sum())
    row_lost = row_maxes[-1] > 0  # a token criterion dropped a token of the row (any rank)
    for option, (lo, hi) in bounds.items():
        kind = option[:-3]
        if kind == "token":
            stat, where = token_stats[option[-2:]], b.keep
        else:
            stat = row_stats[option]
            if kind == "seq_mean":
                stat = b.row_mean(stat)
            stat, where = torch.where(b.rows, stat, 0), b.rows_here
        passed = (stat >= lo) & (stat <= hi)
        if kind != "token":
            row_lost = row_lost | (b.rows & ~passed)
            passed = b.per_token(passed)
        prefix = f"rollout_rs_{option}"
        t.add(f"{prefix}_masked", (b.keep & ~passed).sum())
        t.add(f"{prefix}_sum", _sum(stat, where))
        t.add(f"{prefix}_count", where.sum())
        t.add_max(f"{prefix}_max", _max(stat, where))
        t.add_max(f"{prefix}_neg_min", _max(-stat, where))
        keep = keep & passed
    t.add("masked", (b.keep & ~keep).sum())
    t.add("seq_masked", (row_lost & b.rows_here).sum())
    r = b.reduce(t)

    metrics = {
        "rollout_rs_masked_fraction": _ratio(r["masked"], r["tokens"]),
        "rollout_rs_seq_masked_fraction": _ratio(r["seq_masked"], r["rows"]),
    }
    for option in bounds:
        p = f"rollout_rs_{option}"
        count = r[f"{p}_count"]
        metrics[f"{p}_masked_fraction"] = _ratio(r[f"{p}_masked"], r["tokens"])
        metrics[f"{p}_mean"] = _ratio(r[f"{p}_sum"], count)
        metrics[f"{p}_max"] = _extreme(r[f"{p}_max"], count)
        metrics[f"{p}_min"] = _extreme(-r[f"{p}_neg_min"], count)
    return keep, {k: metrics[k] for k in sorted(metrics)}
