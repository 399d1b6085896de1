"""TRL's GRPO loss (``GRPOTrainer._compute_loss`` of ``trl/trainer/grpo_trainer.py``) on rlops;
its options declared once, in :class:`LossOptions`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_int,
    as_real,
    check_2d,
    check_choice,
    check_count,
    check_finite_positive,
    check_nonneg,
    check_positive,
    check_same_shape,
    is_finite,
    shape_error,
)
from rlops._types import Group
from rlops.losses import ONE_PASS_KINDS

LOSS_TYPES = ("bnpo", "cispo", "dapo", "dr_grpo", "grpo", "luspo", "sapo")
"""TRL's ``loss_type`` values served here (TRL's ``"vespo"`` is not)."""

_PPO_FAMILY = ("bnpo", "dapo", "dr_grpo", "grpo", "luspo")


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """TRL's loss options under ``GRPOConfig``'s names, checked when built (errors name the option,
    its range, the value); ``kind``, ``policy_options`` and ``cap`` are the policy loss they make.
    """

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    max_completion_length: int | None = None
    num_processes: int = 1
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    training: bool = True
    kind: str = dataclasses.field(init=False, repr=False, compare=False)
    policy_options: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)
    cap: float | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)


def _checked(o: LossOptions) -> dict[str, Any]:
    """The options checked under TRL's names, and the policy-loss call they make."""
    check_choice("loss_type", o.loss_type, LOSS_TYPES)
    level = check_choice(
        "importance_sampling_level", o.importance_sampling_level, ("token", "sequence")
    )
    eps_low = check_positive("epsilon", o.epsilon)
    eps_high = eps_low if o.epsilon_high is None else check_positive("epsilon_high", o.epsilon_high)
    out: dict[str, Any] = {"importance_sampling_level": level, "epsilon": eps_low, "cap": None}
    if o.epsilon_high is not None:
        out["epsilon_high"] = eps_high
    if o.loss_type in _PPO_FAMILY:
        options: dict[str, Any] = {"clip_low": eps_low, "clip_high": eps_high}
        if o.delta is not None:
            out["delta"] = options["dual_clip"] = _checked_delta(o.delta, eps_high)
        out["kind"] = "gspo" if level == "sequence" else "ppo"
    elif o.loss_type == "cispo":
        if eps_high > 1:
            out["kind"] = "cispo"
            options = {"clip_low": math.inf, "clip_high": eps_high - 1, "level": level}
        else:
            out["kind"], options, out["cap"] = "reinforce", {}, eps_high
    else:
        tau_pos = check_finite_positive("sapo_temperature_pos", o.sapo_temperature_pos)
        tau_neg = check_finite_positive("sapo_temperature_neg", o.sapo_temperature_neg)
        out["kind"] = "sapo"
        options = {"tau_pos": tau_pos, "tau_neg": tau_neg, "level": level}
    out["policy_options"] = options
    return {**out, **_checked_scales(o)}


def _checked_delta(delta: float, eps_high: float) -> float:
    """TRL's ``delta``, rlops's dual clip: only where ``delta >= 1 + epsilon_high``."""
    delta = check_positive("delta", delta)
    if delta < 1 + eps_high:
        raise ValueError(
            f"delta must be >= 1 + epsilon_high = {1 + eps_high} here (TRL's two-sided "
            f"clip is rlops's dual clip only there; TRL recommends delta > 1 + "
            f"epsilon), got {delta}"
        )
    return delta


def _checked_scales(o: LossOptions) -> dict[str, Any]:
    """The KL, entropy and normaliser options checked under TRL's names."""
    beta = check_nonneg("beta", o.beta)
    rho = as_real("top_entropy_quantile", o.top_entropy_quantile)
    if not 0 <= rho <= 1:  # NaN too
        raise ValueError(
            "top_entropy_quantile must be in [0, 1] (TRL's range: the top quantile of the tokens "
            f"by entropy kept; 0 keeps the highest-entropy token, 1 every token), got "
            f"{o.top_entropy_quantile}"
        )
    coef = as_real("entropy_coef", o.entropy_coef)
    if not is_finite(coef):
        raise ValueError(f"entropy_coef must be a finite number, got {o.entropy_coef}")
    length = o.max_completion_length
    if length is not None:
        length = as_int("max_completion_length", length, 1, tensor=False)
    if o.loss_type == "dr_grpo" and length is None:
        raise ValueError(
            "loss_type='dr_grpo' needs max_completion_length, an int >= 1 (TRL divides the "
            "token sums by it), got None"
        )
    steps = o.steps_per_generation
    return {
        "beta": beta,
        "top_entropy_quantile": rho,
        "entropy_coef": coef,
        "max_completion_length": length,
        "num_processes": as_int("num_processes", o.num_processes, 1, tensor=False),
        "steps_per_generation": (
            None if steps is None else as_int("steps_per_generation", steps, 1, tensor=False)
        ),
        "gradient_accumulation_steps": as_int(
            "gradient_accumulation_steps", o.gradient_accumulation_steps, 1, tensor=False
        ),
    }


class Batch(NamedTuple):
    """A micro-batch checked: log-probs, old log-probs, advantages ``[B, T]``, bool mask."""

    logps: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    keep: torch.Tensor


def checked_batch(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
) -> Batch:
    """TRL's tensors checked under TRL's names (``old`` None: on-policy)."""
    lp = check_2d("per_token_logps", per_token_logps)
    old = lp.detach() if old_per_token_logps is None else old_per_token_logps
    check_same_shape("per_token_logps", lp, old_per_token_logps=old)
    keep = as_bool_mask("completion_mask", completion_mask, lp.shape, "per_token_logps", lp)
    b, t = lp.shape
    adv = torch.as_tensor(advantages, device=lp.device)
    if adv.dim() == 1:
        adv = adv[:, None]
    if adv.shape not in ((b, 1), (b, t)):
        raise shape_error("advantages", f"[B] = [{b}] or [B, T] = [{b}, {t}]", tuple(adv.shape))
    return Batch(lp, old, adv.detach().to(lp.dtype).expand(b, t), keep)


def _row_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``Σ_t m·x / max(Σ_t m, 1)`` per row, ``[B, 1]`` (TRL's sequence-level mean)."""
    count = keep.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
    return torch.where(keep, x, 0).sum(-1, keepdim=True) / count


Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _add_mean(
    sums: Sums, name: str, x: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor
) -> None:
    """Record TRL's mean of ``x`` as ``(sum, count)`` (per row for ``[B, 1]``)."""
    if x.shape[-1] == 1:
        sums[name] = (x.sum().detach(), torch.full((), float(keep.shape[0]), device=x.device))
    else:
        sums[name] = (torch.where(keep, x, 0).sum().detach(), tokens)


def _normaliser(
    o: LossOptions, num_items_in_batch: object, lp: torch.Tensor
) -> tuple[str, float | None, torch.Tensor | None]:
    """TRL's normaliser of ``o.loss_type``: ``(agg mode, loss_scale_factor, num_tokens)``."""
    if o.loss_type in ("grpo", "sapo"):
        return "seq-mean-token-mean", None, None
    if o.loss_type == "bnpo":
        return "token-mean", None, None
    if o.loss_type == "dr_grpo":
        assert o.max_completion_length is not None
        return "seq-mean-token-sum-norm", float(o.max_completion_length), None
    if o.loss_type == "luspo":
        return "seq-mean-token-sum", None, None
    # dapo, cispo: num_items_in_batch spans the generation batch
    count = check_count("num_items_in_batch", num_items_in_batch, lp)
    if count is None:
        return "token-mean", None, None
    accumulation = o.gradient_accumulation_steps
    n = torch.as_tensor(count, dtype=lp.dtype, device=lp.device)
    nt = n.clamp(min=1.0) / o.num_processes
    if o.training:
        nt = nt * accumulation / (o.steps_per_generation or accumulation)
    return "token-mean", None, nt


class OnePass(NamedTuple):
    """TRL's loss as one :func:`rlops.linear_policy_loss` call: its keywords, and the divisor of
    the loss it returns (TRL's gradient accumulation)."""

    kwargs: dict[str, Any]
    divisor: int


def one_pass_eligible(o: LossOptions) -> bool:
    """Whether TRL's loss of ``o`` is a loss :func:`rlops.linear_policy_loss` makes in one pass
    with TRL's value and gradients: a token-level kind of :data:`rlops.ONE_PASS_KINDS` weighed by
    nothing read from the log-probs (no KL term, top-entropy mask or cispo cap), and an entropy
    bonus, if any, weighed per token as the policy's normaliser (not grpo's and sapo's row
    means)."""
    return (
        o.beta == 0
        and o.top_entropy_quantile == 1
        and o.importance_sampling_level == "token"
        and o.cap is None
        and o.kind in ONE_PASS_KINDS
        and (o.entropy_coef == 0 or o.loss_type not in ("grpo", "sapo"))
    )


def one_pass_call(
    o: LossOptions, keep: torch.Tensor, num_items_in_batch: object, lp: torch.Tensor
) -> OnePass:
    """The :class:`OnePass` of TRL's loss of ``o`` (:func:`one_pass_eligible`) on the bool mask
    ``keep`` ``[B, T]``, ``lp`` a tensor of the log-probs' dtype and device.

    TRL adds ``−c/ga·Σ m·H / Σ m``; the one pass adds ``−c'·Σ w·H`` with the policy's weight
    ``w`` per action token (``1/n``, ``1/(B·L)`` or ``1/B``), so ``c' = c/(ga·s·w·Σ m)`` with
    ``s`` the scale of the returned loss (``1/ga`` but for dapo and cispo)."""
    mode, lsf, nt = _normaliser(o, num_items_in_batch, lp)
    ga = o.gradient_accumulation_steps if o.training else 1
    divisor = 1 if o.loss_type in ("dapo", "cispo") else ga
    aggregation = {"loss_scale_factor": lsf, "num_tokens": nt, "empty_rows": "count"}
    coef: float | torch.Tensor = o.entropy_coef * divisor / ga
    if o.entropy_coef != 0 and not (mode == "token-mean" and nt is None):
        rows = float(keep.shape[0])
        per_token = {"seq-mean-token-sum-norm": rows * (lsf or 1.0), "seq-mean-token-sum": rows}
        inverse_w = per_token[mode] if nt is None else nt  # 1/w
        tokens = keep.sum().clamp_min(1).to(lp.dtype)
        coef = coef * inverse_w / tokens
    kwargs = {"kind": o.kind, "agg": mode, "entropy_coef": coef, **aggregation}
    return OnePass({**kwargs, **o.policy_options}, divisor)


def _clip_stats(
    o: LossOptions, x: Batch, ratio: torch.Tensor, sums: Sums, tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """TRL's clip metrics into ``sums``; the per-row values whose min / max TRL logs."""
    lp, keep = x.logps, x.keep
    seq = o.importance_sampling_level == "sequence"
    a = x.adv[:, :1] if seq else x.adv
    per_row: dict[str, torch.Tensor] = {}
    if o.loss_type in _PPO_FAMILY:
        eps_low, eps_high = o.policy_options["clip_low"], o.policy_options["clip_high"]
        low = ((ratio < 1 - eps_low) & (a < 0)).to(lp.dtype).detach()
        high = ((ratio > 1 + eps_high) & (a > 0)).to(lp.dtype).detach()
        for name, m in (("low", low), ("high", high), ("region", torch.maximum(low, high))):
            _add_mean(sums, f"clip_ratio/{name}_mean", m, keep, tokens)
        for name, m in (("low_min", low), ("high_max", high)):
            per_row[f"clip_ratio/{name}"] = (
                m[:, 0] if seq else torch.where(keep, m, 0).sum(-1) / keep.sum(-1).to(lp.dtype)
            )
    elif o.loss_type == "cispo":
        cap = o.policy_options["clip_high"] + 1 if o.cap is None else o.cap
        clipped = ((ratio > cap) & (a > 0)).to(lp.dtype).detach()
        _add_mean(sums, "cispo_clip_ratio", clipped, keep, tokens)
    return per_row


def loss_and_stats(
    x: Batch,
    o: LossOptions,
    ref_per_token_logps: torch.Tensor | None,
    entropies: torch.Tensor | None,
    num_items_in_batch: float | torch.Tensor | None,
    group: Group,
) -> tuple[torch.Tensor, torch.Tensor, Sums, dict[str, torch.Tensor], torch.Tensor | None]:
    """:func:`grpo_loss` on checked inputs: ``(loss, policy_loss, sums, per_row, bonus)``,
    ``bonus`` the detached ``[entropy sum, token count]`` over the bonus's tokens (TRL's
    adaptive controller's window statistics), None without entropies."""
    lp, old, adv, keep = x
    b, t = lp.shape
    rho, entropy_coef = o.top_entropy_quantile, o.entropy_coef
    if (entropy_coef != 0 or rho < 1) and entropies is None:
        raise ValueError(
            "entropies ([B, T]) are needed with entropy_coef != 0 or top_entropy_quantile < 1"
        )
    if entropies is not None:
        check_same_shape("per_token_logps", lp, entropies=entropies)
    log_ratio = torch.where(keep, lp - old.detach(), 0)
    seq = o.importance_sampling_level == "sequence"
    ratio = torch.exp(_row_mean(log_ratio, keep) if seq else log_ratio)  # TRL's coef_1
    weights = entropy_keep = None
    if rho < 1:
        assert entropies is not None
        entropy_keep = rlops.top_entropy_mask(entropies.detach(), keep, rho=rho, group=group)[0]
        weights = entropy_keep.to(lp.dtype)
    if o.cap is not None:  # cispo with an absolute cap <= 1: reinforce with sg(min(r, cap))
        capped = ratio.detach().clamp(max=o.cap).expand(b, t)
        weights = capped if weights is None else weights * capped
    loss_mat = rlops.policy_loss(
        lp, old, adv, keep, kind=o.kind, rollout_is_weights=weights, agg=None, **o.policy_options
    )[0]
    sums: Sums = {}
    tokens = keep.sum().to(lp.dtype)
    if o.beta != 0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps ([B, T]) is needed with beta != 0")
        check_same_shape("per_token_logps", lp, ref_per_token_logps=ref_per_token_logps)
        kl = rlops.kl_penalty(lp, ref_per_token_logps, "k3")
        if o.use_bias_correction_kl:
            kl = kl * ratio  # the ratio keeps its gradient, as TRL's
        loss_mat = loss_mat + o.beta * torch.where(keep, kl, 0)
        _add_mean(sums, "kl", kl, keep, tokens)
    mode, lsf, nt = _normaliser(o, num_items_in_batch, lp)
    # TRL's sequence means divide by every row, with an action token or not
    policy = rlops.aggregate_loss(
        loss_mat, keep, mode, loss_scale_factor=lsf, num_tokens=nt, empty_rows="count"
    )
    ga = o.gradient_accumulation_steps if o.training else 1
    loss = policy if o.loss_type in ("dapo", "cispo") else policy / ga
    effective = keep if entropy_keep is None else keep & entropy_keep
    bonus = None
    if entropy_coef != 0:
        assert entropies is not None
        loss = loss + rlops.entropy_loss(entropies, effective, coef=entropy_coef / ga)[0]
    if entropies is not None:
        _add_mean(sums, "entropy", entropies, keep, tokens)
        # TRL's torch.stack of the two sums (the count promoted to the entropies' dtype)
        bonus = torch.stack([torch.where(effective, entropies, 0).sum(), effective.sum()])
        bonus = bonus.detach()
    per_row = _clip_stats(o, x, ratio, sums, tokens)
    return loss, policy.detach(), sums, per_row, bonus


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    entropies: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int | None = None,
    training: bool = True,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's GRPO loss of one micro-batch (``GRPOTrainer._compute_loss`` after the log-probs).

    With ``r = exp(log π − log π_old)`` per token, or of its row mean
    (``importance_sampling_level="sequence"``), per token::

        grpo, bnpo, dr_grpo, dapo, luspo   −min(r·A, clip(r, 1 − ε_l, 1 + ε_h)·A)
        cispo                              −sg(min(r, ε_h))·A·log π
        sapo                               −σ(τ·(r − 1))·4/τ·A

    times the top-entropy mask, plus ``beta·k3`` (times ``r``), aggregated by ``loss_type``'s
    normaliser, minus ``entropy_coef`` times the mean entropy; the other keywords are TRL's options
    under ``GRPOConfig``'s names (docs/integration-trl.md).

    Args:
        per_token_logps: ``[B, T]`` the policy's log-probs; ``old_per_token_logps`` the
            sampler's (None: on-policy), ``ref_per_token_logps`` the reference's (for ``beta``).
        advantages: ``[B]`` or ``[B, T]``; ``completion_mask``: ``[B, T]`` 0/1.

    Returns:
        ``(loss, metrics)``: the 0-dim loss and TRL's detached metrics under TRL's names.

    Example:
        >>> import math
        >>> logp = torch.tensor([[-1.0, -0.5], [-2.0, 0.0]], requires_grad=True)
        >>> mask = torch.tensor([[1, 1], [1, 0]])
        >>> loss, m = grpo_loss(logp, logp.detach() - 0.5, torch.tensor([1.0, -1.0]), mask,
        ...                     loss_type="grpo")
        >>> round(loss.item(), 4), round((-1.2 + math.exp(0.5)) / 2, 4)  # row 0 clipped at 1.2
        (0.2244, 0.2244)
        >>> round(m["clip_ratio/high_mean"].item(), 4)  # 2 of the 3 tokens
        0.6667
    """
    x = checked_batch(per_token_logps, old_per_token_logps, advantages, completion_mask)
    options = LossOptions(
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        max_completion_length=max_completion_length,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        training=training,
    )
    loss, policy, sums, per_row, _ = loss_and_stats(
        x, options, ref_per_token_logps, entropies, num_items_in_batch, group
    )
    metrics = {"policy_loss": policy}
    for name, (s, n) in sums.items():
        metrics[name] = s / n.clamp_min(1)
    for name, v in per_row.items():
        metrics[name] = _nan_extreme(v, largest=not name.endswith("_min"))
    return loss, metrics


def _nan_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """TRL's ``nanmin`` / ``nanmax`` by a masked reduction (no host read)."""
    if x.numel() == 0:
        return x.new_full((), math.nan)
    nan = torch.isnan(x)
    fill = -math.inf if largest else math.inf
    filled = torch.where(nan, fill, x)
    out = filled.amax() if largest else filled.amin()
    return torch.where(nan.all(), math.nan, out)
