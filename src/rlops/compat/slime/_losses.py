"""slime's KL and losses (``slime/utils/ppo_utils.py``, ``megatron_utils/loss.py``)."""

from __future__ import annotations

import math

import torch

import rlops
from rlops._checks import check_positive, check_same_shape
from rlops.compat.slime._corrections import token_ratios
from rlops.compat.slime._cp import response_values


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate in float32 (k1, k2, k3, ``low_var_kl``), times ``importance_ratio``.

    Example:
        >>> compute_approx_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), "k3")
        tensor([0.1065, 0.7183])
    """
    if kl_loss_type not in ("k1", "k2", "k3", "low_var_kl"):
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    kind = "k3" if kl_loss_type == "low_var_kl" else kl_loss_type
    kl = rlops.kl_penalty(log_probs.float(), log_probs_base.float(), kind)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    return kl


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
):
    """PPO's clipped loss per token (https://arxiv.org/abs/1707.06347): ``(pg_losses, clipfrac)``.

    Example:
        >>> compute_policy_loss(torch.tensor([0.0, -0.5]), torch.tensor([1.0, 1.0]), 0.2, 0.2)
        (tensor([-1.0000, -1.2000]), tensor([0., 1.]))
    """
    check_same_shape("ppo_kl", ppo_kl, advantages=advantages)
    low = check_positive("eps_clip", eps_clip)
    high = check_positive("eps_clip_high", eps_clip_high)
    if eps_clip_c is not None:
        eps_clip_c = check_positive("eps_clip_c (dual-clip)", eps_clip_c, above=1.0)
    dtype = torch.promote_types(ppo_kl.dtype, advantages.dtype)
    logp = -ppo_kl.to(dtype).reshape(1, -1)  # the log-ratio, against old log-probs of 0
    old, adv = torch.zeros_like(logp), advantages.to(dtype).reshape(1, -1)
    everywhere = torch.ones_like(logp, dtype=torch.bool)

    def per_token(clip_low, clip_high, dual_clip=None):
        loss, _ = rlops.policy_loss(
            logp,
            old,
            adv,
            everywhere,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            agg=None,
        )
        return loss

    low = math.inf if low >= 1 else low
    with torch.no_grad():
        unclipped = per_token(math.inf, math.inf)
        clipped = per_token(low, high) if eps_clip_c is not None else None
    loss = per_token(low, high, eps_clip_c)
    clipfrac = torch.gt(loss.detach() if clipped is None else clipped, unclipped)
    shape = ppo_kl.shape
    return loss.reshape(shape).to(dtype), clipfrac.reshape(shape).float()


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
):
    """CISPO per token (https://arxiv.org/abs/2506.13585): ``(pg_losses, clipfrac)``.

    Example:
        >>> pg, frac = compute_cispo_loss(torch.tensor([0.0, -0.5]), torch.tensor([-1.0, -0.5]),
        ...                               torch.tensor([1.0, 1.0]), 0.2, 0.2)
        >>> pg, frac
        (tensor([1.0000, 0.6000]), tensor([0., 1.]))
    """
    check_same_shape("ppo_kl", ppo_kl, log_probs=log_probs, advantages=advantages)
    low = check_positive("eps_clip", eps_clip)
    high = check_positive("eps_clip_high", eps_clip_high)
    dtype = torch.promote_types(
        torch.promote_types(ppo_kl.dtype, log_probs.dtype), advantages.dtype
    )
    logp = log_probs.reshape(1, -1).double()
    old = logp.detach() + ppo_kl.reshape(1, -1).detach().double()
    loss, _ = rlops.policy_loss(
        logp,
        old,
        advantages.reshape(1, -1).double(),
        torch.ones_like(logp, dtype=torch.bool),
        kind="cispo",
        clip_low=math.inf if low >= 1 else low,
        clip_high=high,
        agg=None,
    )
    ratio, weight = token_ratios(
        -ppo_kl.double(), 1.0 + high, None if low >= 1 else 1.0 - low, "truncate"
    )
    return loss.reshape(ppo_kl.shape).to(dtype), (weight != ratio).to(dtype)


def value_loss_function(args, batch, logits, sum_of_sample_mean, *, cp_group=None):
    """slime's critic loss ``max((V_clip − R)², (V − R)²)`` and clip fraction: ``(loss, metrics)``.

    Example:
        >>> from argparse import Namespace
        >>> logits = torch.tensor([1.0, 3.0, 0.0]).reshape(1, 3, 1)  # V = [1, 3]
        >>> batch = {"values": [torch.ones(2)], "returns": [torch.zeros(2)],
        ...          "total_lengths": [3], "response_lengths": [2]}
        >>> loss, m = value_loss_function(Namespace(value_clip=0.5), batch, logits, torch.mean)
        >>> loss, m["value_clipfrac"]
        (tensor(5.), tensor(0.5000))
    """
    clip = check_positive("value_clip", args.value_clip)
    per_sample = response_values(
        logits,
        batch["total_lengths"],
        batch["response_lengths"],
        allgather_cp=bool(getattr(args, "allgather_cp", False)),
        cp_group=cp_group,
    )
    values = torch.cat([v.flatten() for v in per_sample])
    old = torch.cat(list(batch["values"]))
    returns = torch.cat(list(batch["returns"]))
    check_same_shape(
        "values read from logits", values, **{'batch["values"]': old, 'batch["returns"]': returns}
    )
    half_squared, _ = rlops.value_loss(
        values[None],
        old[None],
        returns[None],
        torch.ones_like(values[None], dtype=torch.bool),
        clip=clip,
        agg=None,
    )
    clipfrac = ((values - old).abs() > clip).to(values.dtype)
    loss = sum_of_sample_mean(2 * half_squared[0])
    values_clipfrac = sum_of_sample_mean(clipfrac)
    if values.numel() == 0:  # keep the graph connected to the value head, as slime
        loss = loss + 0 * values.sum()
    return loss, {
        "value_loss": loss.clone().detach(),
        "value_clipfrac": values_clipfrac.clone().detach(),
    }
