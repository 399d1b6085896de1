"""TRL's GRPO advantages and loss on rlops (the functions of :mod:`rlops.compat.trl`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_int,
    as_real,
    as_real_vector,
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

__all__ = ["LOSS_TYPES", "SUPPORTED_TRL", "grpo_advantages", "grpo_loss"]

SUPPORTED_TRL = ">=1.16,<1.17"
"""The TRL versions :class:`GRPOMixin` is tested against (the ``trl`` extra pins them)."""

LOSS_TYPES = ("bnpo", "cispo", "dapo", "dr_grpo", "grpo", "luspo", "sapo")
"""TRL's ``loss_type`` values served here (TRL's ``"vespo"`` is not)."""

_PPO_FAMILY = ("bnpo", "dapo", "dr_grpo", "grpo", "luspo")
_SCALES = ("batch", "group", "none")
_AGGREGATIONS = ("normalize_then_sum", "sum_then_normalize")


# --------------------------------------------------------------------------- advantages
def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd``: the Bessel-corrected std of the non-NaN entries, NaN with fewer than 2."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    # the count in x's dtype: Bessel's factor n / (n − 1) of int64 counts would be computed in
    # torch's default float32 (TRL's nanstd does so), a float32 error in float64 rewards
    n = (~torch.isnan(x)).sum(dim=dims, keepdim=True).to(x.dtype)
    var = var * torch.where(n > 1, n / (n - 1).clamp_min(1), math.nan)
    return var.sqrt().squeeze(dims) if dim is None else var.sqrt()


def _check_reward_weights(reward_weights: object, f: int) -> torch.Tensor:
    """TRL's ``reward_weights``: ``F`` finite numbers. TRL 1.16 does not check them, and its
    ``nansum`` over ``rewards_per_func · w`` drops the column of a NaN weight (weight 0, the
    function ignored without a word): a NaN or infinite weight raises here."""
    return as_real_vector("reward_weights", reward_weights, f, "rewards_per_func")


def grpo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: torch.Tensor | list[float] | None = None,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
) -> torch.Tensor:
    """TRL's GRPO advantages, one per completion: ``[B]``.

    The rows are ``B / num_generations`` groups of ``num_generations`` consecutive completions
    of the same prompt (TRL's sampler layout), ``F`` reward functions, weights ``w``.
    ``nanmean`` and ``nanstd`` (Bessel-corrected) skip NaN entries: a reward function that
    returned None for a completion. ``sum_then_normalize`` (TRL's default)::

        r_i = Σ_f w_f·r_if          (NaN where every r_if is NaN: an unscorable completion)
        A_i = (r_i − nanmean_g r) / (nanstd r + eps)   nanstd over the group (scale_rewards=
              "group"), over the whole batch ("batch"); "none" leaves out the division

    ``normalize_then_sum``: each function standardised in its group, ``(r_if − μ_gf) /
    (σ_gf + eps)``, then weighted and summed into ``r_i``, then standardised over the batch.
    Finally NaN advantages become 0 (``nan_to_num``): an unscorable completion, a group with a
    single scored completion under group scaling. The statistics run over the rows given: pass
    the rewards of every process (TRL gathers them) and slice this process's rows after.

    Args:
        rewards_per_func: ``[B, F]`` (or ``[B]``: one function) floating rewards, NaN where a
            function gave none.
        num_generations: ``G >= 1`` completions per prompt, dividing ``B``.
        reward_weights: ``[F]`` finite weights (TRL's ``reward_weights``), default all 1. A
            NaN or infinite weight raises ``ValueError`` (TRL 1.16 takes a NaN weight as 0:
            its ``nansum`` drops the column; a NaN weight is a configuration error, not an
            unscored reward). A weight tensor on an accelerator is checked where rlops reads
            values (``RLOPS_CHECK_VALUES=1``).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (``True`` is ``"group"``,
            ``False`` ``"none"``, as TRL's config reads them).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        eps: ``>= 0`` added to the std (TRL: 1e-4).

    Returns:
        ``[B]`` advantages in the rewards' dtype (float32 for integer rewards), computed in
        it: float64 rewards get float64 accuracy (TRL's ``nanstd`` takes Bessel's factor in
        float32).

    Example:
        >>> import torch
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 1.0, float("nan")]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    r = torch.as_tensor(rewards_per_func)
    if not r.is_floating_point():
        r = r.float()
    if r.dim() == 1:
        r = r[:, None]
    if r.dim() != 2:
        raise shape_error("rewards_per_func", "[B, F] or [B]", tuple(r.shape))
    b, f = r.shape
    if isinstance(num_generations, bool) or not isinstance(num_generations, int):
        raise TypeError(f"num_generations must be an int, got {type(num_generations).__name__}")
    if num_generations < 1 or b % num_generations:
        raise ValueError(
            f"num_generations must be >= 1 and divide the batch size B = {b} (groups of "
            f"num_generations consecutive rows), got {num_generations}"
        )
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    check_choice("scale_rewards", scale_rewards, _SCALES)
    check_choice("multi_objective_aggregation", multi_objective_aggregation, _AGGREGATIONS)
    eps = check_nonneg("eps", eps)
    w = _weights(None if reward_weights is None else _check_reward_weights(reward_weights, f), r)
    g = num_generations
    unscorable = torch.isnan(r).all(dim=1)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = torch.where(unscorable, math.nan, (r * w).nansum(dim=1))
        grouped = rewards.view(-1, g)
        mean = torch.nanmean(grouped, dim=1, keepdim=True).expand(-1, g).reshape(b)
        if scale_rewards == "batch":
            std = _nanstd(rewards).expand(b) if b > 1 else torch.zeros_like(rewards)
        else:
            std = (
                _nanstd(grouped, 1).expand(-1, g).reshape(b) if g > 1 else torch.zeros_like(rewards)
            )
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + eps)
    else:
        grouped = r.view(-1, g, f)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = _nanstd(grouped, 1) if g > 1 else torch.zeros_like(mean_k)
        per_func = ((grouped - mean_k) / (std_k + eps)).view(b, f)
        rewards = torch.where(unscorable, math.nan, (per_func * w).nansum(dim=1))
        std = _nanstd(rewards).expand(b) if b > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + eps)
    return torch.nan_to_num(adv, nan=0.0)


def _weights(w: torch.Tensor | None, r: torch.Tensor) -> torch.Tensor:
    """The reward weights ``[F]`` on the rewards' device, in their dtype. Weights on the host
    (TRL keeps them in a CPU tensor; a list is checked into one) are read there and filled in
    on the device as numbers: no copy of host data to the device."""
    f = r.shape[1]
    if w is None:
        return torch.ones(f, dtype=r.dtype, device=r.device)
    if w.device == r.device:
        return w.to(r.dtype)
    values = w.to(r.dtype).tolist() if w.device.type == "cpu" else None
    if values is None:  # another accelerator: a device-to-device copy
        return w.to(device=r.device, dtype=r.dtype)
    out = torch.empty(f, dtype=r.dtype, device=r.device)
    for j, v in enumerate(values):
        out[j] = v
    return out


# --------------------------------------------------------------------------- loss
class _Plan(NamedTuple):
    """TRL's loss options, checked, as rlops's arguments (:func:`_check_options`)."""

    kind: str  # rlops.policy_loss's kind
    options: dict[str, Any]  # its options
    cap: float | None  # cispo's cap <= 1 (reinforce with the weight sg(min(r, cap))), else None
    level: str  # importance_sampling_level
    beta: float
    rho: float  # top_entropy_quantile
    entropy_coef: float
    max_completion_length: int | None
    num_processes: int
    steps_per_generation: int | None


def _check_options(
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    delta: float | None,
    importance_sampling_level: str,
    beta: float,
    top_entropy_quantile: float,
    entropy_coef: float,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    max_completion_length: int | None,
    num_processes: int,
    steps_per_generation: int | None,
) -> _Plan:
    """TRL's loss options (Python numbers, read on the host) as a :class:`_Plan`; errors name
    TRL's option, its range and the value given (:class:`GRPOMixin` runs this at
    construction, :func:`grpo_loss` at each call)."""
    check_choice("loss_type", loss_type, LOSS_TYPES)
    level = check_choice(
        "importance_sampling_level", importance_sampling_level, ("token", "sequence")
    )
    eps_low = check_positive("epsilon", epsilon)
    eps_high = eps_low if epsilon_high is None else check_positive("epsilon_high", epsilon_high)
    cap = None
    if loss_type in _PPO_FAMILY:
        kind = "gspo" if level == "sequence" else "ppo"
        options: dict[str, Any] = {"clip_low": eps_low, "clip_high": eps_high}
        if delta is not None:
            delta = check_positive("delta", delta)
            if delta < 1 + eps_high:
                raise ValueError(
                    f"delta must be >= 1 + epsilon_high = {1 + eps_high} here (TRL's two-sided "
                    f"clip is rlops's dual clip only there; TRL recommends delta > 1 + "
                    f"epsilon), got {delta}"
                )
            options["dual_clip"] = delta
    elif loss_type == "cispo":
        if eps_high > 1:
            kind, options = (
                "cispo",
                {"clip_low": math.inf, "clip_high": eps_high - 1, "level": level},
            )
        else:
            kind, options, cap = "reinforce", {}, eps_high
    else:
        tau_pos = check_finite_positive("sapo_temperature_pos", sapo_temperature_pos)
        tau_neg = check_finite_positive("sapo_temperature_neg", sapo_temperature_neg)
        kind, options = "sapo", {"tau_pos": tau_pos, "tau_neg": tau_neg, "level": level}
    beta = check_nonneg("beta", beta)
    rho = as_real("top_entropy_quantile", top_entropy_quantile)
    if not 0 <= rho <= 1:  # NaN too
        raise ValueError(
            "top_entropy_quantile must be in [0, 1] (TRL's range: the top quantile of the tokens "
            f"by entropy kept; 0 keeps the highest-entropy token, 1 every token), got "
            f"{top_entropy_quantile}"
        )
    coef = as_real("entropy_coef", entropy_coef)
    if not is_finite(coef):
        raise ValueError(f"entropy_coef must be a finite number, got {entropy_coef}")
    length = (
        None
        if max_completion_length is None
        else as_int("max_completion_length", max_completion_length, 1, tensor=False)
    )
    if loss_type == "dr_grpo" and length is None:
        raise ValueError(
            "loss_type='dr_grpo' needs max_completion_length, an int >= 1 (TRL divides the "
            "token sums by it), got None"
        )
    return _Plan(
        kind=kind,
        options=options,
        cap=cap,
        level=level,
        beta=beta,
        rho=rho,
        entropy_coef=coef,
        max_completion_length=length,
        num_processes=as_int("num_processes", num_processes, 1, tensor=False),
        steps_per_generation=(
            None
            if steps_per_generation is None
            else as_int("steps_per_generation", steps_per_generation, 1, tensor=False)
        ),
    )


def _row_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``Σ_t m·x / max(Σ_t m, 1)`` per row, ``[B, 1]`` (TRL's sequence-level mean)."""
    return torch.where(keep, x, 0).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(
        1
    ).to(x.dtype)


def _loss_and_stats(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    delta: float | None,
    importance_sampling_level: str,
    beta: float,
    ref_per_token_logps: torch.Tensor | None,
    use_bias_correction_kl: bool,
    entropies: torch.Tensor | None,
    top_entropy_quantile: float,
    entropy_coef: float,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    max_completion_length: int | None,
    num_items_in_batch: float | torch.Tensor | None,
    num_processes: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int | None,
    training: bool,
    group: Group,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    dict[str, tuple[torch.Tensor, torch.Tensor]],
    dict[str, torch.Tensor],
]:
    """:func:`grpo_loss` on checked arguments: ``(loss, policy_loss, sums, per_row)`` with
    ``sums`` a TRL metric's ``(sum, count)`` over this call and ``per_row`` the per-row values
    whose min / max TRL logs (NaN for a row without completion tokens)."""
    check_2d("per_token_logps", per_token_logps)
    lp = per_token_logps
    old = lp.detach() if old_per_token_logps is None else old_per_token_logps
    check_same_shape("per_token_logps", lp, old_per_token_logps=old)
    keep = as_bool_mask("completion_mask", completion_mask, lp.shape, "per_token_logps", lp)
    b, t = lp.shape
    adv = torch.as_tensor(advantages, device=lp.device)
    if adv.dim() == 1:
        adv = adv[:, None]
    if adv.shape not in ((b, 1), (b, t)):
        raise shape_error("advantages", f"[B] = [{b}] or [B, T] = [{b}, {t}]", tuple(adv.shape))
    adv = adv.detach().to(lp.dtype).expand(b, t)
    plan = _check_options(
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        max_completion_length=max_completion_length,
        num_processes=num_processes,
        steps_per_generation=steps_per_generation,
    )
    options, cap, beta, rho, entropy_coef = (
        plan.options,
        plan.cap,
        plan.beta,
        plan.rho,
        plan.entropy_coef,
    )
    accumulation = as_int(
        "gradient_accumulation_steps", gradient_accumulation_steps, 1, tensor=False
    )
    ga = accumulation if training else 1
    if (entropy_coef != 0 or rho < 1) and entropies is None:
        raise ValueError(
            "entropies ([B, T]) are needed with entropy_coef != 0 or top_entropy_quantile < 1"
        )
    if entropies is not None:
        check_same_shape("per_token_logps", lp, entropies=entropies)

    log_ratio = torch.where(keep, lp - old.detach(), 0)
    seq = plan.level == "sequence"
    coef_1 = torch.exp(_row_mean(log_ratio, keep) if seq else log_ratio)  # TRL's ratio

    weights = entropy_keep = None
    if rho < 1:
        assert entropies is not None
        entropy_keep = rlops.top_entropy_mask(entropies.detach(), keep, rho=rho, group=group)[0]
        weights = entropy_keep.to(lp.dtype)
    if cap is not None:  # cispo with an absolute cap <= 1: reinforce with sg(min(r, cap))
        capped = coef_1.detach().clamp(max=cap).expand(b, t)
        weights = capped if weights is None else weights * capped
    loss_mat = rlops.policy_loss(
        lp, old, adv, keep, kind=plan.kind, rollout_is_weights=weights, agg=None, **options
    )[0]
    sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    tokens = keep.sum().to(lp.dtype)

    def token_mean(name: str, x: torch.Tensor) -> None:
        if x.shape[-1] == 1:  # one value per row (sequence level): TRL divides by B
            sums[name] = (x.sum().detach(), torch.full((), float(b), device=x.device))
        else:
            sums[name] = (torch.where(keep, x, 0).sum().detach(), tokens)

    if beta != 0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps ([B, T]) is needed with beta != 0")
        check_same_shape("per_token_logps", lp, ref_per_token_logps=ref_per_token_logps)
        kl = rlops.kl_penalty(lp, ref_per_token_logps, "k3")
        if use_bias_correction_kl:
            kl = kl * coef_1  # the ratio keeps its gradient, as TRL's
        loss_mat = loss_mat + beta * torch.where(keep, kl, 0)
        token_mean("kl", kl)

    if loss_type in ("grpo", "sapo"):
        mode, lsf, nt = "seq-mean-token-mean", None, None
    elif loss_type == "bnpo":
        mode, lsf, nt = "token-mean", None, None
    elif loss_type == "dr_grpo":
        assert plan.max_completion_length is not None
        mode, lsf, nt = "seq-mean-token-sum-norm", float(plan.max_completion_length), None
    elif loss_type == "luspo":
        mode, lsf, nt = "seq-mean-token-sum", None, None
    else:  # dapo, cispo: num_items_in_batch spans the generation batch
        mode, lsf = "token-mean", None
        count = check_count("num_items_in_batch", num_items_in_batch, lp)
        if count is None:
            nt = None
        else:
            spg = plan.steps_per_generation or accumulation
            n = torch.as_tensor(count, dtype=lp.dtype, device=lp.device)
            nt = n.clamp(min=1.0) / plan.num_processes
            if training:
                nt = nt * accumulation / spg
    # TRL's sequence means divide by every row, with an action token or not
    policy = rlops.aggregate_loss(
        loss_mat, keep, mode, loss_scale_factor=lsf, num_tokens=nt, empty_rows="count"
    )
    loss = policy if loss_type in ("dapo", "cispo") else policy / ga
    if entropy_coef != 0:
        assert entropies is not None
        effective = keep if entropy_keep is None else keep & entropy_keep
        loss = loss + rlops.entropy_loss(entropies, effective, coef=entropy_coef / ga)[0]

    per_row: dict[str, torch.Tensor] = {}
    if entropies is not None:
        token_mean("entropy", entropies)
    if loss_type in _PPO_FAMILY:
        eps_low = options["clip_low"]
        eps_high = options["clip_high"]
        a = adv[:, :1] if seq else adv
        low = ((coef_1 < 1 - eps_low) & (a < 0)).to(lp.dtype).detach()
        high = ((coef_1 > 1 + eps_high) & (a > 0)).to(lp.dtype).detach()
        for name, x in (("low", low), ("high", high), ("region", torch.maximum(low, high))):
            token_mean(f"clip_ratio/{name}_mean", x)
        for name, x in (("low_min", low), ("high_max", high)):
            per_row[f"clip_ratio/{name}"] = (
                x[:, 0] if seq else (torch.where(keep, x, 0).sum(-1) / keep.sum(-1).to(lp.dtype))
            )
    elif loss_type == "cispo":
        cap_value = options["clip_high"] + 1 if cap is None else cap
        a = adv[:, :1] if seq else adv
        token_mean("cispo_clip_ratio", ((coef_1 > cap_value) & (a > 0)).to(lp.dtype).detach())
    return loss, policy.detach(), sums, per_row


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

    With ``lr = log π − log π_old``, the ratio ``r = exp(lr)`` (``importance_sampling_level=
    "token"``) or ``exp(mean_i lr)`` over row i's completion tokens (``"sequence"``), ``A`` the
    advantage of the row, per token (the kinds of :func:`rlops.policy_loss`, see the module
    docstring for the mapping)::

        grpo, bnpo, dr_grpo, dapo, luspo   −min(r·A, clip(r, 1 − ε_l, 1 + ε_h)·A)
                                           (r capped at delta where A < 0, with delta)
        cispo                              −sg(min(r, ε_h))·A·log π
        sapo                               −σ(τ·(r − 1))·4/τ·A, τ = sapo_temperature_pos
                                           where A > 0, else sapo_temperature_neg

    times the top-entropy mask, plus ``beta·k3·r`` (``k3 = e^(ref − log π) − (ref − log π) −
    1``; ``r`` with its gradient when ``use_bias_correction_kl``), aggregated by TRL's
    ``loss_type`` normaliser, minus ``entropy_coef`` times the mean entropy of the tokens kept
    (divided by ``gradient_accumulation_steps`` in training). Rows without a completion token
    count in the sequence means (TRL divides by B).

    Args:
        per_token_logps: ``[B, T]`` log-probs of the completion tokens under the policy.
        old_per_token_logps: ``[B, T]`` under the sampling policy, or None (on-policy:
            ``per_token_logps`` detached, as TRL).
        advantages: ``[B]`` (TRL's) or ``[B, T]``; constants.
        completion_mask: ``[B, T]`` 0/1 (TRL's ``completion_mask`` times its ``tool_mask``).
        loss_type: one of :data:`LOSS_TYPES`.
        epsilon, epsilon_high, delta: TRL's clip options (``epsilon_high`` defaults to
            ``epsilon``; cispo's cap); ``delta`` None or ``>= 1 + epsilon_high``.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        beta: ``>= 0`` the KL coefficient; ``ref_per_token_logps`` ``[B, T]`` needed when > 0.
        use_bias_correction_kl: multiply the KL by the ratio (TRL's default True).
        entropies: ``[B, T]`` per-token entropies, needed with ``top_entropy_quantile < 1`` or
            ``entropy_coef != 0`` (with their gradient for the latter).
        top_entropy_quantile: ``ρ`` in ``[0, 1]`` (TRL's range): train on the tokens whose
            entropy is at least the ``1 − ρ`` quantile (``torch.quantile``'s) over every
            process of ``group``; 1 keeps every token, 0 those tied with the largest entropy.
        entropy_coef: the entropy bonus coefficient (TRL's static one), a finite number.
        sapo_temperature_pos, sapo_temperature_neg: sapo's ``τ`` (finite, ``> 0``).
        max_completion_length: None or an int ``>= 1``, dr_grpo's constant length (needed
            there).
        num_items_in_batch: completion tokens of the generation batch over every process (TRL's
            gathered count, a number or a 0-dim tensor ``>= 0``), for dapo and cispo; None: this
            call's own count.
        num_processes, gradient_accumulation_steps, steps_per_generation: TRL's, ints ``>= 1``
            (defaults 1, 1, ``gradient_accumulation_steps``).
        training: False for TRL's evaluation mode (no accumulation scaling).
        group: the process group of the data-parallel processes, for the entropy quantile, or
            None (this process only).

    Returns:
        ``(loss, metrics)``: the 0-dim loss to backpropagate and TRL's metrics over this call
        (detached 0-dim): ``policy_loss``, ``entropy`` (with ``entropies``), ``kl`` (with
        ``beta``), ``clip_ratio/{low,high,region}_mean``, ``clip_ratio/low_min`` and
        ``clip_ratio/high_max`` (ppo family), ``cispo_clip_ratio`` (cispo).

    Example:
        >>> import math, torch
        >>> logp = torch.tensor([[-1.0, -0.5], [-2.0, 0.0]], requires_grad=True)
        >>> mask = torch.tensor([[1, 1], [1, 0]])
        >>> loss, m = grpo_loss(logp, logp.detach() - 0.5, torch.tensor([1.0, -1.0]), mask,
        ...                     loss_type="grpo")
        >>> # r = e^0.5 everywhere: row 0 (A = 1) clipped at 1.2, row 1 (A = -1) not
        >>> round(loss.item(), 4), round((-1.2 + math.exp(0.5)) / 2, 4)
        (0.2244, 0.2244)
        >>> round(m["clip_ratio/high_mean"].item(), 4)  # 2 of the 3 tokens
        0.6667
    """
    loss, policy, sums, per_row = _loss_and_stats(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        ref_per_token_logps=ref_per_token_logps,
        use_bias_correction_kl=use_bias_correction_kl,
        entropies=entropies,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        training=training,
        group=group,
    )
    metrics = {"policy_loss": policy}
    for name, (s, n) in sums.items():
        metrics[name] = s / n.clamp_min(1)
    for name, x in per_row.items():
        metrics[name] = _nan_extreme(x, largest=not name.endswith("_min"))
    return loss, metrics


def _nan_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """TRL's ``nanmin`` / ``nanmax`` of ``x`` ``[B]``: the extreme of its non-NaN entries, NaN
    when there is none. A masked reduction (NaN made ``±inf``, then put back where every entry
    was NaN): no selection of a data-dependent size, no host read."""
    if x.numel() == 0:
        return x.new_full((), math.nan)
    nan = torch.isnan(x)
    fill = -math.inf if largest else math.inf
    filled = torch.where(nan, fill, x)
    out = filled.amax() if largest else filled.amin()
    return torch.where(nan.all(), math.nan, out)
