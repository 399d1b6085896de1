"""Estimators written as their definitions: a loop over time, vectorised over the batch only,
or a loop over groups (MaxRL, GiGPO) or rows (the overlong penalty).

Used for ``method="reference"`` and, in float64, as oracles in tests. Not exported.
"""

from __future__ import annotations

import torch

from rlops.advantages._masking import GaeInputs
from rlops.scan.decay import decayed

__all__ = [
    "gae_reference",
    "gigpo_reference",
    "maxrl_reference",
    "overlong_penalty_reference",
]


def gae_reference(x: GaeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over action tokens, the definition: a loop back in time on :class:`GaeInputs` with the
    (value, advantage) of the next action token as state, from ``(end, 0)`` (or ``(0, 0)``):

        at a done:           state = (cut[t], 0)          (nothing flows from t+1)
        at an action token:  A[t] = r[t] + gamma * next_value - V[t] + gamma * lam * next_advantage
                             state = (V[t], A[t])
        at a mask-0 token:   A[t] = 0, state unchanged

    Returns ``(advantages, returns)``; without values both are the discounted return.
    """
    rewards, values, mask, dones, cut, end = x.rewards, x.values, x.mask, x.dones, x.cut, x.end
    gamma, gamma_lam = x.gamma, x.gamma_lam
    n, t_len = rewards.shape
    zero = rewards.new_zeros(n)
    next_value = zero if end is None else end.to(rewards.dtype)
    next_adv = zero
    adv = torch.zeros_like(rewards)
    for t in reversed(range(t_len)):
        if dones is not None:
            after = zero if cut is None else cut[:, t]
            next_value = torch.where(dones[:, t], after, next_value)
            next_adv = torch.where(dones[:, t], zero, next_adv)
        v_t = values[:, t] if values is not None else zero
        # a zero discount is an exact cut: what follows is selected away, not multiplied by 0
        delta = rewards[:, t] + decayed(gamma, next_value) - v_t
        a_t = delta + decayed(gamma_lam, next_adv)
        act = mask[:, t] if mask is not None else torch.ones_like(zero, dtype=torch.bool)
        adv[:, t] = torch.where(act, a_t, zero)
        next_adv = torch.where(act, a_t, next_adv)
        next_value = torch.where(act, v_t, next_value)
    if values is None:
        return adv, adv
    ret = values + adv
    if mask is not None:
        ret = torch.where(mask, ret, 0.0)
    return adv, ret


def _groups(keys: list) -> dict:
    """Row indices by key, in order of first appearance."""
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return groups


def maxrl_reference(
    scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, eps: float = 0.0
) -> torch.Tensor:
    """MaxRL's ``[B, T]`` advantages, a loop over groups in the scores' dtype: ``(s − μ)/(μ +
    eps)`` where ``μ > 0`` (else 0) in groups of two or more, the score itself alone."""
    a = torch.zeros_like(scores)
    for rows in _groups(index.tolist()).values():
        s = scores[rows]
        mean = s.sum() / len(rows)
        if len(rows) == 1:
            a[rows] = s
        elif mean > 0:
            a[rows] = (s - mean) / (mean + eps)
    return a[:, None] * (mask != 0)


def _roll_normalised(x: torch.Tensor, keys: list, norm_std: bool, eps: float) -> torch.Tensor:
    """``x`` centred in its group (over every row of the group), divided by the unbiased std
    plus ``eps`` with ``norm_std``; 0 for a group of one or a std ``<= eps``."""
    out = torch.zeros_like(x)
    for rows in _groups(keys).values():
        g = x[rows]
        if len(rows) == 1:
            continue
        centred = g - g.sum() / len(rows)
        if not norm_std:
            out[rows] = centred
            continue
        std = torch.sqrt((centred * centred).sum() / (len(rows) - 1))
        if std > eps:
            out[rows] = centred / (std + eps)
    return out


def gigpo_reference(
    episode_scores: torch.Tensor,
    index: torch.Tensor,
    step_rewards: torch.Tensor,
    anchor_ids: torch.Tensor,
    mask: torch.Tensor,
    episode_reward_weight: float = 1.0,
    step_reward_weight: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO's ``[B, T]`` advantages, loops over groups: the episode score normalised in its
    ``index`` group plus the step return normalised in its ``(index, anchor)`` group."""
    ids = index.tolist()
    ep = _roll_normalised(episode_scores, ids, norm_std, eps)
    st = _roll_normalised(step_rewards, list(zip(ids, anchor_ids.tolist())), norm_std, eps)
    a = episode_reward_weight * ep + step_reward_weight * st
    return a[:, None] * (mask != 0)


def overlong_penalty_reference(
    lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's overlong penalty per row, a loop: ``min(−(L − (max_len − cache_len))/cache_len ·
    factor, 0)``."""
    out = torch.zeros(lengths.shape, dtype=torch.float64)
    for i, length in enumerate(lengths.tolist()):
        out[i] = min(-(length - (max_len - cache_len)) / cache_len * factor, 0.0)
    return out
