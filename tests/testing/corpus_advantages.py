"""A corpus for :func:`rlops.testing.check_advantages`: correct estimators, which must pass every
check, and broken ones, each of which must fail the check it names.

Each entry is a :class:`~tests.testing.corpus_logprobs.Case`: the function, the contract's
keywords (``estimator``) it is checked with, and (for a broken one) the check it targets.
The functions follow the contract's call: ``fn(rewards [B, T], values [B, T], mask [B, T],
gamma, lam) -> advantages [B, T]`` (``fn(rewards, mask, gamma)`` for ``estimator="returns"``);
rlops' own estimators are passed as they are (keyword-only ``gamma``, ``lam``, ``mask``).
"""

from __future__ import annotations

import torch
from tests.testing.corpus_logprobs import Case

import rlops

__all__ = ["BROKEN", "CORRECT"]


def serial_gae(
    rewards,
    values,
    mask,
    gamma,
    lam,
    dones=None,
    *,
    dtype=torch.float64,
    restart=False,
    ignore_dones=False,
    lam_at_dones=False,
    bootstrap_last=False,
    swap=False,
):
    """GAE as a loop over time in ``dtype``, mask-0 tokens skipped (the next *action* token's
    value and advantage carried over them), 0 past the end and past a done. The keywords
    are bugs: ``restart`` (a mask-0 span ends the episode), ``ignore_dones``,
    ``lam_at_dones`` (at a done the carried advantage is scaled by λ, not zeroed),
    ``bootstrap_last`` (the value after the row's end is its last value, not 0) and
    ``swap`` (γ and λ exchanged)."""
    if swap:
        gamma, lam = lam, gamma
    r, v = rewards.to(dtype), values.to(dtype)
    b, t_len = r.shape
    next_v = v[:, -1].clone() if bootstrap_last else r.new_zeros(b)
    next_a = r.new_zeros(b)
    out = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        if dones is not None and not ignore_dones:
            next_v = torch.where(dones[:, t], 0.0, next_v)
            next_a = torch.where(dones[:, t], lam * next_a if lam_at_dones else 0.0, next_a)
        m = mask[:, t].bool()
        if restart:
            after = mask[:, t + 1].bool() if t + 1 < t_len else torch.zeros_like(m)
            next_v = torch.where(m & ~after, 0.0, next_v)
            next_a = torch.where(m & ~after, 0.0, next_a)
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        out[:, t] = torch.where(m, a, 0.0)
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, v[:, t], next_v)
    return out.to(rewards.dtype)


# --------------------------------------------------------------------------- correct
def float64_loop(rewards, values, mask, gamma, lam, dones=None):
    """GAE token by token in float64 (mask-0 tokens skipped, dones honoured)."""
    return serial_gae(rewards, values, mask, gamma, lam, dones)


def verl_loop(rewards, values, mask, gamma, lam):
    """verl's ``compute_gae_advantage_return`` loop (its newer form, which skips the
    observation tokens: value and advantage carried through mask 0), in the inputs' dtype,
    without verl's final whitening of the advantages."""
    m = mask.to(rewards.dtype)
    nextvalues = torch.zeros_like(rewards[:, 0])
    lastgaelam = torch.zeros_like(rewards[:, 0])
    reversed_out = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        reversed_out.append(lastgaelam)
    return torch.stack(reversed_out[::-1], dim=1)


def returns_loop(rewards, mask, gamma, dones=None):
    """Discounted reward-to-go token by token in float64 (mask-0 tokens skipped)."""
    return serial_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0, dones)


CORRECT: dict[str, Case] = {
    "rlops.gae": Case(rlops.gae, {}),
    "rlops.discounted_returns": Case(rlops.discounted_returns, {"estimator": "returns"}),
    "float64_loop": Case(float64_loop, {}),
    "verl_loop": Case(verl_loop, {}),
    "returns_loop": Case(returns_loop, {"estimator": "returns"}),
}


# --------------------------------------------------------------------------- broken
def bootstrap_from_last_value(rewards, values, mask, gamma, lam):
    """values: the value after the row's last token read as ``V[T − 1]`` rather than 0."""
    return serial_gae(rewards, values, mask, gamma, lam, bootstrap_last=True)


def gamma_lam_swapped(rewards, values, mask, gamma, lam):
    """values: γ and λ exchanged (``δ = r + λ·V' − V``, still ``γλ`` on the carry)."""
    return serial_gae(rewards, values, mask, gamma, lam, swap=True)


def next_value_off_by_one(rewards, values, mask, gamma, lam):
    """values: ``δ_t = r_t + γ·V_t − V_t`` (the token's own value for the next one's)."""
    a = torch.zeros_like(rewards, dtype=torch.float64)
    carry = torch.zeros_like(rewards[:, 0], dtype=torch.float64)
    for t in reversed(range(rewards.shape[-1])):
        m = mask[:, t].bool()
        v = values[:, t].double()
        x = rewards[:, t].double() + gamma * v - v + gamma * lam * carry
        a[:, t] = torch.where(m, x, 0.0)
        carry = torch.where(m, x, carry)
    return a.to(rewards.dtype)


def mask_as_restart(rewards, values, mask, gamma, lam):
    """masks: each turn its own episode (the estimator restarts at tool output)."""
    return serial_gae(rewards, values, mask, gamma, lam, restart=True)


def mask_ignored(rewards, values, mask, gamma, lam):
    """masks: the mask not read: tool-output tokens treated as actions."""
    return serial_gae(rewards, values, torch.ones_like(mask, dtype=torch.bool), gamma, lam)


def mask_zeroed(rewards, values, mask, gamma, lam):
    """masks: rewards and values zeroed on mask-0 tokens, which are then decayed through
    (slime's batch GAE, which takes no mask)."""
    m = mask.to(rewards.dtype)
    ones = torch.ones_like(mask, dtype=torch.bool)
    return serial_gae(rewards * m, values * m, ones, gamma, lam)


def dones_ignored(rewards, values, mask, gamma, lam, dones=None):
    """dones: takes ``dones=`` and ignores it: value and advantage leak across packed
    sequences."""
    return serial_gae(rewards, values, mask, gamma, lam, dones, ignore_dones=True)


def lam_at_dones(rewards, values, mask, gamma, lam, dones=None):
    """dones: at a done the carried advantage is multiplied by λ once more instead of being
    zeroed (the bootstrap value is zeroed correctly)."""
    return serial_gae(rewards, values, mask, gamma, lam, dones, lam_at_dones=True)


def float16_accumulation(rewards, values, mask, gamma, lam):
    """long_rows: the carries held in float16 (and inputs rounded to it): a few digits, and
    thousands of steps of rounding."""
    return serial_gae(rewards, values, mask, gamma, lam, dtype=torch.float16).float()


def inverse_power_scaling(rewards, values, mask, gamma, lam):
    """long_rows: ``A_t = w^{−t}·Σ_{k≥t} w^k·δ_k`` (``w = γλ``) as a cumulative sum in
    float32: ``w^k`` underflows and ``w^{−t}`` overflows within a few thousand tokens."""
    m = mask.to(rewards.dtype)
    v_next = torch.cat([values[:, 1:] * m[:, 1:], values.new_zeros(values.shape[0], 1)], 1)
    delta = (rewards + gamma * v_next - values) * m
    w = torch.tensor(gamma * lam, dtype=torch.float32)
    t = torch.arange(rewards.shape[1], dtype=torch.float32)
    tail = (delta * w**t).flip(-1).cumsum(-1).flip(-1)
    return tail * w ** (-t) * m


def log_space_scan(rewards, values, mask, gamma, lam):
    """edges: the same scan with the powers in log space, in float64: ``log 0 = −inf`` at
    ``γλ = 0`` gives ``0·inf = NaN``."""
    m = mask.to(rewards.dtype)
    v_next = torch.cat([values[:, 1:] * m[:, 1:], values.new_zeros(values.shape[0], 1)], 1)
    delta = (rewards + gamma * v_next - values) * m
    t = torch.arange(rewards.shape[1], dtype=torch.float64)
    log_w = torch.log(torch.tensor(gamma * lam, dtype=torch.float64))
    tail = (delta.double() * torch.exp(t * log_w)).flip(-1).cumsum(-1).flip(-1)
    return (tail * torch.exp(-t * log_w) * m).float()


def returns_undiscounted(rewards, mask, gamma):
    """values: the reward-to-go without the discount (γ taken as 1)."""
    return returns_loop(rewards, mask, 1.0)


def returns_mask_restart(rewards, mask, gamma):
    """masks: returns that restart at every span of mask 0."""
    zeros = torch.zeros_like(rewards)
    return serial_gae(rewards, zeros, mask, gamma, 1.0, restart=True)


BROKEN: dict[str, Case] = {
    fn.__name__: Case(fn, options, check)
    for fn, options, check in [
        (bootstrap_from_last_value, {}, "values"),
        (gamma_lam_swapped, {}, "values"),
        (next_value_off_by_one, {}, "values"),
        (mask_as_restart, {}, "masks"),
        (mask_ignored, {}, "masks"),
        (mask_zeroed, {}, "masks"),
        (dones_ignored, {}, "dones"),
        (lam_at_dones, {}, "dones"),
        (float16_accumulation, {}, "long_rows"),
        (inverse_power_scaling, {}, "long_rows"),
        (log_space_scan, {}, "edges"),
        (returns_undiscounted, {"estimator": "returns"}, "values"),
        (returns_mask_restart, {"estimator": "returns"}, "masks"),
    ]
}
