"""Estimators written as their definitions: a loop over time, vectorised over the batch only.

Used for ``method="reference"`` and, in float64, as oracles in tests. Not exported.
"""

from __future__ import annotations

import torch

from rlops.advantages._masking import GaeInputs
from rlops.scan.decay import decayed

__all__ = ["gae_reference"]


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
