"""TRL's GRPO advantages (``trl/trainer/grpo_trainer.py``) on torch alone."""

from __future__ import annotations

import math

import torch

from rlops._checks import as_real_vector, check_choice, check_nonneg, shape_error

_SCALES = ("batch", "group", "none")
_AGGREGATIONS = ("normalize_then_sum", "sum_then_normalize")


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


def check_reward_weights(reward_weights: object, f: int) -> torch.Tensor:
    """TRL's ``reward_weights``: ``F`` finite numbers."""
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

    ``r_i = Σ_f w_f·r_if``, ``A_i = (r_i − nanmean_g r) / (nanstd r + eps)`` over groups of
    ``num_generations`` rows (``normalize_then_sum``: each function standardised first); NaN
    (unscored) rewards skipped, NaN advantages 0.

    Args:
        rewards_per_func: ``[B, F]`` (or ``[B]``) floating rewards, NaN where a function gave none.
        num_generations: ``G >= 1`` completions per prompt, dividing ``B``.
        reward_weights: ``[F]`` finite weights, default all 1.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (or TRL's booleans).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        eps: ``>= 0`` added to the std.

    Returns:
        ``[B]`` advantages in the rewards' dtype (float32 for integer rewards).

    Example:
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
    w = _weights(None if reward_weights is None else check_reward_weights(reward_weights, f), r)
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
    """The reward weights on the rewards' device and dtype, with no host-to-device copy."""
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
