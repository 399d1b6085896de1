"""REINFORCE++ token returns: the discounted returns of the KL-penalised token reward plus
the outcome score on each row's last action token, over action tokens only."""

from __future__ import annotations

import torch

from rlops._checks import (
    as_float_tensor,
    check_2d,
    check_nonneg,
    check_same_device,
    compute_dtype,
    per_row_discount,
    shape_error,
)
from rlops.advantages.compiled import has_zero, reinforce_returns_compiled
from rlops.advantages.gae import discounted_returns, indicators
from rlops.advantages.masking import as_rows
from rlops.scan import resolve_method

__all__ = ["reinforce_plus_plus_returns"]


def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float | torch.Tensor,
    method: str = "auto",
    cp_group: object | None = None,
) -> torch.Tensor:
    """REINFORCE++ token returns (Hu, 2025, https://arxiv.org/abs/2501.03262).

    The token reward is ``-kl_coef * kl[t]`` on action tokens, plus the outcome score
    ``rewards[b]`` on the row's last action token; the returns are the discounted returns of
    that reward over action tokens, with mask-0 tokens (tool output, observations) *skipped*:
    the outcome reaches every earlier action, discounted once per action step.

    Args:
        rewards: ``[B]`` outcome scores (floating).
        kl: ``[B, T]`` per-token KL estimates (e.g. from :func:`rlops.kl_penalty`).
        mask: ``[B, T]`` bool or 0/1, 1 = action token. A row with no action token gives 0s.
        kl_coef: the KL coefficient (>= 0).
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        method: as in :func:`discounted_returns`.
        cp_group: a context-parallel process group; ``kl``, ``mask`` and the output are this
            rank's zigzag shards, ``rewards`` is ``[B]`` on every rank. The outcome lands on
            the globally last action token, found from the exchanged carries (one collective).

    Returns:
        ``[B, T]`` returns in the promoted dtype of ``rewards`` and ``kl``, 0 on mask-0 tokens.

    Example:
        >>> import torch, rlops
        >>> kl = torch.zeros(1, 4)
        >>> m = torch.tensor([[1, 0, 1, 0]])
        >>> rlops.reinforce_plus_plus_returns(torch.tensor([1.0]), kl, m, kl_coef=0.1, gamma=0.5)
        tensor([[0.5000, 0.0000, 1.0000, 0.0000]])
    """
    kl = check_2d("kl", kl)
    rewards = as_float_tensor("rewards", rewards)
    if mask is None:
        raise TypeError("mask must be a [B, T] tensor (1 = action token), got None")
    if isinstance(mask, torch.Tensor) and mask.shape != kl.shape:
        raise ValueError(
            f"kl and mask must have the same shape [B, T], got kl {list(kl.shape)} and "
            f"mask {list(mask.shape)}"
        )
    b, t_len = kl.shape
    if tuple(rewards.shape) != (b,):
        raise shape_error("rewards", f"[B] = [{b}] (one outcome score per row)", rewards.shape)
    check_same_device("kl", kl, rewards=rewards)
    mask, _ = indicators(kl.shape, kl, mask, None)
    kl_coef = check_nonneg("kl_coef", kl_coef)
    dtype = torch.promote_types(rewards.dtype, kl.dtype)
    if cp_group is None and compute_dtype(dtype) == dtype:
        gamma_ = per_row_discount("gamma", gamma, b, kl)
        if resolve_method(method, kl, rewards, gamma_) == "compiled" and not has_zero(gamma_):
            # one pass from the KL: the token rewards are never written (same values as below)
            rows = as_rows(gamma_, b, torch.float64, kl.device)
            return reinforce_returns_compiled(kl.to(dtype), rewards.to(dtype), mask, kl_coef, rows)
    token_rewards = torch.where(mask, -kl_coef * kl.to(dtype), 0.0)
    if cp_group is not None:
        from rlops.advantages.context_parallel import cp_reinforce_returns

        gamma_ = per_row_discount("gamma", gamma, b, kl)
        cdt = compute_dtype(dtype)
        method = resolve_method(method, kl)
        out = cp_reinforce_returns(
            token_rewards.to(cdt),
            rewards.to(cdt),
            mask,
            as_rows(gamma_, b, cdt, kl.device),
            cp_group,
            method,
            kl_coef,
        )
        return out.to(dtype)
    if t_len > 0:
        # the last action token of each row: T-1 - (first action index in the flipped row)
        last = (t_len - 1) - mask.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        outcome = torch.where(mask.any(-1), rewards.to(dtype), 0.0).unsqueeze(-1)
        token_rewards = token_rewards.scatter_add(1, last, outcome)
    return discounted_returns(token_rewards, gamma=gamma, mask=mask, method=method)
