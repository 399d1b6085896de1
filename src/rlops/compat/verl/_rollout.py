"""verl's rollout correction (``rollout_corr_helper.py``): string options parsed for rlops."""

from __future__ import annotations

import math
import types

import torch

import rlops
from rlops._checks import as_bool_mask, check_2d, check_choice, check_same_shape
from rlops._numerics import MAX_EXP_ARG
from rlops._types import Group
from rlops.corrections import RS_OPTIONS

_IS_METRICS = (
    "rollout_is_eff_sample_size",
    "rollout_is_max",
    "rollout_is_mean",
    "rollout_is_min",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
)
_MISMATCH = ("chi2_seq", "chi2_token", "k3_kl", "kl")


def _number(name: str, text: str) -> float:
    """``float(text)``; a ValueError naming ``name`` otherwise."""
    try:
        return float(text)
    except ValueError as exc:
        raise ValueError(f"{name}: invalid number {text!r}") from exc


def parse_rollout_is_threshold(spec: object) -> tuple[float, float | None]:
    """``rollout_is_threshold`` (TIS ``2.0``, IcePop ``'0.5_2.0'``) as ``(upper, lower)``."""
    name = "rollout_is_threshold"
    if isinstance(spec, bool):
        raise TypeError(f"{name} must be a number or a 'lower_upper' string, not a boolean")
    if not isinstance(spec, int | float | str):
        raise TypeError(f"{name} must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{name} must not be an empty string")
        if "_" in text:
            low_text, high_text = text.split("_", 1)
            lower, upper = _number(name, low_text), _number(name, high_text)
        else:
            upper = _number(name, text)
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"{name} upper bound must be positive, got {upper}")
    if lower is not None:
        if not lower > 0:
            raise ValueError(f"{name} lower bound must be positive, got {lower}")
        if lower > upper:
            raise ValueError(f"{name} lower bound must be <= upper bound, got {spec!r}")
    return upper, lower


def parse_rollout_rs(
    rollout_rs: object, rollout_rs_threshold: object
) -> dict[str, float | tuple[float, float]]:
    """``rollout_rs`` and its thresholds as :func:`rlops.rollout_rejection_mask`'s criteria."""
    if not isinstance(rollout_rs, str):
        raise ValueError(
            "rollout_rs must be a non-empty string (comma separated for several "
            f"options), got {rollout_rs!r}"
        )
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError("rollout_rs must contain at least one option")
    for option in options:
        check_choice("rollout_rs option", option, RS_OPTIONS)
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(rollout_rs_threshold, bool) or not isinstance(
        rollout_rs_threshold, int | float | str
    ):
        raise TypeError(
            f"rollout_rs_threshold must be a number or a string, got {rollout_rs_threshold!r}"
        )
    if isinstance(rollout_rs_threshold, str):
        specs = [s.strip() for s in rollout_rs_threshold.split(",") if s.strip()]
    else:
        specs = [str(rollout_rs_threshold)]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold must give one threshold for every option or "
            f"{len(options)} (one per rollout_rs option), got {len(specs)}"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    criteria: dict[str, float | tuple[float, float]] = {}
    for option, spec in zip(options, specs, strict=True):
        name = f"rollout_rs_threshold for {option}"
        if option.endswith("k1"):
            if "_" in spec:
                low_text, high_text = spec.split("_", 1)
                lower, upper = _number(name, low_text), _number(name, high_text)
            else:
                upper = _number(name, spec)
                lower = 1.0 / upper if upper > 0 else upper
            if not (lower > 0 and upper > 0):
                raise ValueError(f"{name} must be positive, got {spec!r}")
            if lower > upper:
                raise ValueError(f"{name} must have lower <= upper, got {spec!r}")
            criteria[option] = (lower, upper)
        else:
            if "_" in spec:
                raise ValueError(f"{name} must be one upper bound without '_', got {spec!r}")
            upper = _number(name, spec)
            if not upper > 0:
                raise ValueError(f"{name} must be positive, got {spec!r}")
            criteria[option] = upper
    return criteria


def _inputs(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` ``[bs, T]`` checked; its ``response_mask`` as bool."""
    check_2d("log_ratio", log_ratio)
    return as_bool_mask("response_mask", response_mask, log_ratio.shape, "log_ratio", log_ratio)


def _require_tokens(mask: torch.Tensor) -> None:
    """verl's check (a value read, as in verl), skipped while torch.compile traces."""
    if not torch.compiler.is_compiling() and not bool(mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1)")


def _distributed_group() -> Group:
    """verl normalises over every rank once torch.distributed is initialised."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout IS weights (TIS ``u`` or IcePop ``"l_u"``): ``(rollout_is_weights, metrics)``.

    Example:
        >>> w, m = compute_rollout_correction_weights(
        ...     torch.tensor([[0.0, 1.0, -1.0]]), torch.ones(1, 3), "token", "0.5_2.0")
        >>> w, round(m["rollout_is_oob_ratio"], 4)
        (tensor([[1., 0., 0.]]), 0.6667)
    """
    mask = _inputs(log_ratio, response_mask)
    check_choice("rollout_is", rollout_is, ("token", "sequence"))
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    if not isinstance(rollout_is_batch_normalize, bool):
        raise TypeError(
            "rollout_is_batch_normalize must be a bool, got "
            f"{type(rollout_is_batch_normalize).__name__}"
        )
    _require_tokens(mask)
    weights, _, metrics = rlops.rollout_importance_weights(
        log_ratio,
        torch.zeros_like(log_ratio),
        mask,
        level=rollout_is,
        mode="truncate" if lower is None else "mask",
        threshold=upper,
        low=lower,
    )
    out = {k: metrics[k].item() for k in _IS_METRICS}
    floor = 1.0 / upper if lower is None else lower  # verl's metrics read TIS's floor as 1/upper
    if rollout_is == "token":
        if lower is None and floor <= upper:
            below = rlops.rollout_importance_weights(
                log_ratio, torch.zeros_like(log_ratio), mask, threshold=upper, low=floor
            )[2]
            out["rollout_is_ratio_fraction_low"] = below["rollout_is_ratio_fraction_low"].item()
    else:  # verl reads sequence ratios once per row, every row counted (an empty row: ratio 1)
        seq = torch.where(mask, log_ratio.detach(), 0).sum(-1)
        # as verl: exp in the log-ratio's dtype, the max capped at e^20, the min not capped,
        # so it is inf once every row's sum is past the dtype's range (float32: 88.7)
        out["rollout_is_max"] = torch.exp(seq.max().clamp(max=MAX_EXP_ARG)).item()
        out["rollout_is_min"] = torch.exp(seq.min()).item()
        out["rollout_is_ratio_fraction_high"] = (seq > math.log(upper)).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (seq < math.log(floor)).float().mean().item()
    # verl's spread of the applied weights (clamped to [0, upper]): population std, 0 for one token
    spread = rlops.masked_var(weights.clamp(0, upper), mask, unbiased=False)
    out["rollout_is_std"] = torch.where(mask.sum() > 1, spread.sqrt(), 0.0).item()
    if lower is not None:
        out["rollout_is_oob_ratio"] = (
            metrics["rollout_is_ratio_fraction_high"] + metrics["rollout_is_ratio_fraction_low"]
        ).item()
    if rollout_is_batch_normalize:
        group = _distributed_group()
        if rollout_is == "token":
            mean = rlops.masked_mean(weights, mask, group=group)
        else:
            rows = rlops.masked_mean(weights, mask, dim=-1)
            mean = rlops.masked_mean(rows, mask.any(-1), group=group)
        if mean.item() > 1e-8:
            weights = weights / mean
            out["rollout_is_batch_norm_factor"] = mean.item()
        else:
            out["rollout_is_batch_norm_factor"] = 1.0
    return weights, out


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection by k1 / k2 / k3 divergence: ``(modified_response_mask, metrics)``.

    Example:
        >>> mask, m = compute_rollout_rejection_mask(
        ...     torch.tensor([[0.0, 0.1], [2.0, 0.0]]), torch.ones(2, 2), "seq_max_k2", 0.5)
        >>> mask, m["rollout_rs_masked_fraction"]
        (tensor([[1., 1.],
                [0., 0.]]), 0.5)
    """
    mask = _inputs(log_ratio, response_mask)
    criteria = parse_rollout_rs(rollout_rs, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    _require_tokens(mask)
    keep, metrics = rlops.rollout_rejection_mask(
        log_ratio, torch.zeros_like(log_ratio), mask, criteria
    )
    modified = (response_mask * keep).to(response_mask.dtype)
    out = {k: v.item() for k, v in metrics.items()}
    # verl: the share of all rows (empty ones too) that lost a token
    out["rollout_rs_seq_masked_fraction"] = (mask & ~keep).any(-1).float().mean().item()
    return modified, out


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """verl's rollout/trainer mismatch diagnostics: perplexities, KL, χ² (floats).

    Example:
        >>> m = compute_offpolicy_metrics(torch.tensor([[-1.0, -2.0]]),
        ...                               torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2))
        >>> round(m["kl"], 4), round(m["log_ppl_diff"], 4), round(m["training_log_ppl"], 4)
        (-0.25, -0.25, 1.5)
    """
    check_2d("old_log_prob", old_log_prob)
    mask = as_bool_mask(
        "response_mask", response_mask, old_log_prob.shape, "old_log_prob", old_log_prob
    )
    _require_tokens(mask)
    out = _perplexities("training", old_log_prob, mask)
    if rollout_log_prob is None:
        return out
    check_same_shape("old_log_prob", old_log_prob, rollout_log_prob=rollout_log_prob)
    metrics = rlops.rollout_mismatch_metrics(old_log_prob, rollout_log_prob, mask)
    out.update({k: metrics[k].item() for k in _MISMATCH})
    out.update(_perplexities("rollout", rollout_log_prob, mask))
    # verl's per-row log-perplexity gaps, averaged over every row
    gap = rlops.masked_mean(rollout_log_prob.detach(), mask, dim=-1) - rlops.masked_mean(
        old_log_prob.detach(), mask, dim=-1
    )
    out.update(
        {
            "log_ppl_diff": gap.mean().item(),
            "log_ppl_abs_diff": gap.abs().mean().item(),
            "log_ppl_diff_max": gap.max().item(),
            "log_ppl_diff_min": gap.min().item(),
            "ppl_ratio": torch.exp(gap).mean().item(),
        }
    )
    return {k: out[k] for k in sorted(out)}


def _perplexities(name: str, log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's ``<name>_ppl`` and ``<name>_log_ppl`` (means over rows)."""
    neg = -rlops.masked_mean(log_prob.detach(), mask, dim=-1)
    return {f"{name}_ppl": torch.exp(neg).mean().item(), f"{name}_log_ppl": neg.mean().item()}


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
):
    """IS weights, rejection mask and mismatch metrics: ``(proto, mask, metrics)``.

    Example:
        >>> old, rollout = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -1.0]])
        >>> proto, mask, m = compute_rollout_correction_and_rejection_mask(
        ...     old, rollout, torch.ones(1, 2), rollout_is="token", rollout_is_threshold=2.0)
        >>> proto.batch["rollout_is_weights"], m["rollout_corr/rollout_is_mean"]
        (tensor([[2., 1.]]), 1.5)
    """
    weights, modified, metrics = correction_and_rejection(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        rollout_is,
        rollout_is_threshold,
        rollout_is_batch_normalize,
        rollout_rs,
        rollout_rs_threshold,
    )
    proto = None
    if weights is not None:
        try:
            from verl.protocol import DataProto
        except ImportError:
            proto = types.SimpleNamespace(batch={"rollout_is_weights": weights})
        else:
            proto = DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, modified, metrics


def correction_and_rejection(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None,
    rollout_is_threshold: str | float | None,
    rollout_is_batch_normalize: bool,
    rollout_rs: str | None,
    rollout_rs_threshold: str | float | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The combined call with the weights as a tensor (None when IS is off)."""
    check_2d("old_log_prob", old_log_prob)
    check_same_shape("old_log_prob", old_log_prob, rollout_log_prob=rollout_log_prob)
    mask = as_bool_mask(
        "response_mask", response_mask, old_log_prob.shape, "old_log_prob", old_log_prob
    )
    _require_tokens(mask)
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    modified = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be given when rollout_rs is set")
        modified, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    metrics = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    return weights, modified, metrics
