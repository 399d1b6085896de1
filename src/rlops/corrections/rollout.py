"""Rollout-training mismatch (verl's ``rollout_is``, ``rollout_rs``) from ``d = old_logp −
rollout_logp`` on action tokens; numerical and distributed rules: docs/design/losses.md."""

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
    """Checked inputs: the masked log-ratio ``d``, the bool mask and its :class:`Rows`."""

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
        """The whole rows' counts and sums of ``d``, ``sums`` and maxima of ``maxes``."""
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
        """``t`` reduced over ``group``, else over ``cp_group``, in one collective."""
        if self.group is None and self.rowset.cp:
            return t.reduce(self.cp_group, self.call, "cp_group")
        return t.reduce(self.group, self.call)


def _k3(d: torch.Tensor) -> torch.Tensor:
    """``ρ − 1 − log ρ = expm1(d) − d`` (≥ 0), ``d`` clamped to at most ``MAX_EXP_ARG``."""
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
    """Batch-wide sums and maxima (of ``−x`` for a minimum), reduced in one collective."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value

    def add_max(self, name: str, value: torch.Tensor) -> None:
        self.maxes[name] = value

    def reduce(self, group: Group, call: Call, name: str = "group") -> dict[str, torch.Tensor]:
        """Sums and maxima over every rank of ``group`` (one checked ``gather``)."""
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
    """How far the rollout policy is from the trainer's (verl's ``compute_offpolicy_metrics``): with
    ``d = log ρ`` on the ``N`` action tokens, ``S_b`` its sum over row b's ``n_b``, ``R`` rows::

        kl = Σ −d / N                  k3_kl = Σ (ρ − 1 − log ρ) / N     (KL(π_rollout ‖ π_train))
        chi2_token = Σ (ρ² − 1) / N    chi2_seq = Σ_b (exp(2·S_b) − 1) / R
        log_ppl_diff = Σ_b (−S_b / n_b) / R   (log PPL_train − log PPL_rollout)

    Args:
        old_logp, rollout_logp, mask, group, cp_group, cp_layout, seq_ids, seqs_per_row: as
            :func:`rollout_importance_weights`'s.

    Returns:
        The five metrics, detached 0-dim tensors.

    Example:
        >>> import torch
        >>> old, m = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[1, 1, 0]])
        >>> r = rollout_mismatch_metrics(old, old - torch.tensor([[0.25, -0.5, 0.0]]), m)
        >>> r["kl"], r["k3_kl"], r["chi2_token"]
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
    """Importance weights ``π_train / π_rollout`` that correct a loss for the rollout mismatch; with
    ``d = old_logp − rollout_logp``, ``S_b = Σ d`` over row b's action tokens ``A_b`` and
    ``[L, H] = [log low, log threshold]`` (TIS: https://fengyao.notion.site/off-policy-rl)::

        level="token"      ℓ = d                 mode="truncate"  w = exp(clamp(ℓ, L, H))
        level="sequence"   ℓ = S_b               mode="mask"      w = exp(ℓ) if L ≤ ℓ ≤ H
        level="geometric"  ℓ = S_b / |A_b|                        else 0 (MIS / IcePop)

    Args:
        old_logp, rollout_logp: ``[B, T]`` trainer and rollout-engine log-probs of the tokens.
        mask: ``[B, T]`` 0/1 action mask.
        level, mode, threshold, low: as above (``threshold > 0``, ``low`` None or ≤ it).
        batch_normalize: divide the weights by their mean over the action tokens.
        group, cp_group, cp_layout, seq_ids, seqs_per_row: as :func:`rlops.aggregate_loss`'s.

    Returns:
        ``(weights, keep_mask, metrics)``: ``[B, T]`` weights, ``mask`` less the dropped tokens,
        verl's ``rollout_is_*`` metrics and :func:`rollout_mismatch_metrics`.

    Example:
        >>> import torch
        >>> old, rollout = torch.zeros(1, 3), torch.tensor([[-0.5, 0.0, 0.2]])
        >>> rollout_importance_weights(old, rollout, torch.ones(1, 3), threshold=1.5)[0]
        tensor([[1.5000, 1.0000, 0.8187]])
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
    """Bounds ``(low, high)`` of one rejection option's statistic (k1's in log space)."""
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
    """Reject tokens or rows whose rollout log-probs disagree too much with the trainer's (verl's
    ``rollout_rs``): with ``d = log ρ``, ``k1 = −d``, ``k2 = d²/2``, ``k3 = ρ − 1 − log ρ``;
    ``"token_kX"`` tests each token, ``"seq_{sum,mean,max}_kX"`` the row (dropped whole); k2 / k3
    must be ``<= upper``, k1 in ``[log lower, log upper]``; every criterion must pass.

    Args:
        old_logp, rollout_logp, mask: as :func:`rollout_importance_weights`'s.
        criteria: option of :data:`RS_OPTIONS` -> ``upper``, or ``(lower, upper)`` for k1.
        group, cp_group, cp_layout, seq_ids, seqs_per_row: as :func:`rlops.aggregate_loss`'s.

    Returns:
        ``(keep_mask, metrics)``: ``mask`` less the rejected tokens, verl's ``rollout_rs_*``.

    Example:
        >>> import torch
        >>> old, rollout = torch.zeros(2, 2), torch.tensor([[-0.5, 0.0], [-2.0, 0.5]])
        >>> rollout_rejection_mask(old, rollout, torch.ones(2, 2), {"seq_max_k2": 1.0})[0]
        tensor([[ True,  True],
                [False, False]])
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
