"""verl's rollout-correction diagnostics (``rollout_corr_helper.py``), one host read each."""

from __future__ import annotations

import math

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_float_tensor,
    check_2d,
    check_bool,
    check_choice,
    check_indicator,
    check_positive,
    check_real,
    check_same_device,
    check_same_shape,
    shape_error,
)
from rlops._numerics import MAX_EXP_ARG  # verl's SAFETY_BOUND


def _floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The metrics as Python floats, from one host read."""
    names = list(metrics)
    t = [v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in metrics.values()]
    values = torch.stack([v.detach().double().cpu().reshape(()) for v in t]).tolist()
    return dict(zip(names, values, strict=True))


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (or smallest) entry of ``x`` where ``mask``."""
    fill = -math.inf if largest else math.inf
    y = torch.where(mask, x, fill)
    return y.amax() if largest else y.amin()


def _std(x: torch.Tensor) -> torch.Tensor:
    """The unbiased std, 0 for a single entry."""
    return x.std() if x.numel() > 1 else x.new_zeros(())


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """Diagnostics of the applied IS weights ``[bs, T]`` under verl's keys (floats).

    Example:
        >>> w = torch.tensor([[1.0, 2.0], [0.5, 1.0]])
        >>> m = compute_is_metrics(w, w, w.log(), torch.ones(2, 2), "token", 2.0)
        >>> m["rollout_is_mean"], m["rollout_is_seq_max"]
        (1.125, 1.5)
    """
    w = check_2d("rollout_is_weights", rollout_is_weights).detach()
    check_same_shape("rollout_is_weights", w, raw_rollout_is_weights=raw_rollout_is_weights)
    as_float_tensor("log_ratio_for_metrics", log_ratio_for_metrics)
    check_same_device("rollout_is_weights", w, log_ratio_for_metrics=log_ratio_for_metrics)
    raw = raw_rollout_is_weights.detach()
    mask = as_bool_mask("response_mask", response_mask, w.shape, "rollout_is_weights", w)
    check_choice("rollout_is", rollout_is, ("token", "sequence"))
    upper = check_positive("rollout_is_threshold", rollout_is_threshold)
    lower = (
        1.0 / upper
        if rollout_is_threshold_lower is None
        else check_positive("rollout_is_threshold_lower", rollout_is_threshold_lower)
    )
    if not bool(mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    m: dict[str, torch.Tensor | float] = {}
    log_up = torch.log(torch.tensor(upper, device=w.device))
    log_lo = torch.log(torch.tensor(lower, device=w.device))
    if rollout_is == "sequence":
        lr = log_ratio_for_metrics.detach()
        m["rollout_is_max"] = torch.exp(lr.max().clamp(max=MAX_EXP_ARG))
        m["rollout_is_min"] = torch.exp(lr.min())
        m["rollout_is_mean"] = rlops.masked_mean(w, mask)
        m["rollout_is_ratio_fraction_high"] = (lr > log_up).float().mean()
        m["rollout_is_ratio_fraction_low"] = (lr < log_lo).float().mean()
    else:
        m["rollout_is_mean"] = rlops.masked_mean(w, mask)
        m["rollout_is_ratio_fraction_high"] = rlops.masked_mean((raw > upper).float(), mask)
        m["rollout_is_ratio_fraction_low"] = rlops.masked_mean((raw < lower).float(), mask)
        m["rollout_is_max"] = _masked_extreme(w, mask, True)
        m["rollout_is_min"] = _masked_extreme(w, mask, False)
    c = w.clamp(0.0, upper)
    mean_c = rlops.masked_mean(c, mask)
    if int(mask.sum()) > 1:
        var = rlops.masked_mean(c.square(), mask) - mean_c.square()
        m["rollout_is_std"] = var.clamp_min(0).sqrt()
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / rlops.masked_mean((c / (mean_c + 1e-8)).square(), mask)
    seq = rlops.masked_mean(w, mask, -1)
    m["rollout_is_seq_mean"] = seq.mean()
    m["rollout_is_seq_std"] = _std(seq)
    m["rollout_is_seq_max"] = seq.max()
    m["rollout_is_seq_min"] = seq.min()
    m["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max()
    raw_seq = rlops.masked_mean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean()
    m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean()
    return _floats(m)


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """Diagnostics of a rejection statistic ``[bs, T]`` under ``rollout_rs_<option_name>_``.

    Example:
        >>> x = torch.tensor([[0.1, 0.3], [0.0, 2.0]])
        >>> m = compute_rs_metrics("seq_mean_k3", x, torch.ones(2, 2), torch.ones(2).bool(),
        ...                        level="sequence", per_sequence_values=None,
        ...                        rollout_rs_threshold=0.5, rollout_rs_threshold_lower=0.0,
        ...                        apply_lower_threshold=False)
        >>> m["rollout_rs_seq_mean_k3_max"], m["rollout_rs_seq_mean_k3_fraction_high"]
        (1.0, 0.5)
    """
    x = check_2d("rs_statistic", rs_statistic).detach()
    mask = as_bool_mask("response_mask", response_mask, x.shape, "rs_statistic", x)
    level = check_choice("level", level, ("token", "sequence"))
    if not isinstance(option_name, str):
        raise TypeError(
            f"option_name must be a str (verl's rollout_rs option), got "
            f"{type(option_name).__name__}"
        )
    check_indicator("seq_valid_mask", seq_valid_mask, x.shape[:1], "rs_statistic's rows")
    if per_sequence_values is not None:
        as_float_tensor("per_sequence_values", per_sequence_values)
        if tuple(per_sequence_values.shape) not in ((x.shape[0],), (x.shape[0], 1)):
            raise shape_error(
                "per_sequence_values",
                f"[bs] = [{x.shape[0]}] (or [bs, 1])",
                per_sequence_values.shape,
            )
    upper = check_real("rollout_rs_threshold", rollout_rs_threshold)
    lower = check_real("rollout_rs_threshold_lower", rollout_rs_threshold_lower)
    apply_lower_threshold = check_bool("apply_lower_threshold", apply_lower_threshold)
    if not bool(mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    p = f"rollout_rs_{option_name}"
    seq = (
        per_sequence_values.detach()
        if per_sequence_values is not None
        else (rlops.masked_mean(x, mask, -1))
    )
    if seq.dim() > 1:
        seq = seq.squeeze(-1)
    valid = seq[seq_valid_mask.bool()]
    has = valid.numel() > 0
    m: dict[str, torch.Tensor | float] = {f"{p}_mean": rlops.masked_mean(x, mask)}
    if level == "sequence" and has:
        m[f"{p}_max"], m[f"{p}_min"] = valid.max(), valid.min()
        m[f"{p}_fraction_high"] = (valid > upper).float().mean()
        m[f"{p}_fraction_low"] = (valid < lower).float().mean() if apply_lower_threshold else 0.0
    else:
        m[f"{p}_max"] = _masked_extreme(x, mask, True)
        m[f"{p}_min"] = _masked_extreme(x, mask, False)
        m[f"{p}_fraction_high"] = rlops.masked_mean((x > upper).float(), mask)
        m[f"{p}_fraction_low"] = (
            rlops.masked_mean((x < lower).float(), mask) if apply_lower_threshold else 0.0
        )
    if int(mask.sum()) > 1:
        c = x.clamp(lower if apply_lower_threshold else 0.0, upper)
        var = rlops.masked_mean(c.square(), mask) - rlops.masked_mean(c, mask).square()
        m[f"{p}_std"] = var.clamp_min(0).sqrt()
    else:
        m[f"{p}_std"] = 0.0
    if has:
        m[f"{p}_seq_mean"] = valid.mean()
        m[f"{p}_seq_std"] = _std(valid)
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = valid.max(), valid.min()
        m[f"{p}_seq_max_deviation"] = valid.abs().max()
        m[f"{p}_seq_fraction_high"] = (valid > upper).float().mean()
        if apply_lower_threshold:
            m[f"{p}_seq_fraction_low"] = (valid < lower).float().mean()
    else:
        for k in (
            "seq_mean",
            "seq_std",
            "seq_max",
            "seq_min",
            "seq_max_deviation",
            "seq_fraction_high",
            "seq_fraction_low",
        ):
            m[f"{p}_{k}"] = 0.0
    return _floats(m)
