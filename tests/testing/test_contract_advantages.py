"""``check_advantages``: correct estimators pass; each check fails on a broken estimator with
the bug it names; the ``masks`` check names the semantics a function has."""

from __future__ import annotations

import pytest
import torch

import rlops
from rlops.compat import slime, verl
from rlops.testing import ADVANTAGE_CHECKS, check_advantages

QUICK = {"long_length": 2048}  # long_rows at 2K tokens, except for rlops' own estimator


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
    bootstrap_last=False,
):
    """GAE as a loop over time in ``dtype`` (mask-0 tokens skipped), with optional bugs:
    ``restart`` (a mask-0 span ends the episode), ``ignore_dones``, ``bootstrap_last`` (the
    value after the row's end taken as its last value instead of 0)."""
    r, v = rewards.to(dtype), values.to(dtype)
    b, t_len = r.shape
    next_v = v[:, -1].clone() if bootstrap_last else r.new_zeros(b)
    next_a = r.new_zeros(b)
    out = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        if dones is not None and not ignore_dones:
            next_v = torch.where(dones[:, t], 0.0, next_v)
            next_a = torch.where(dones[:, t], 0.0, next_a)
        m = mask[:, t]
        if restart:
            after = mask[:, t + 1] if t + 1 < t_len else torch.zeros_like(m)
            next_v = torch.where(m & ~after, 0.0, next_v)
            next_a = torch.where(m & ~after, 0.0, next_a)
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        out[:, t] = torch.where(m, a, 0.0)
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, v[:, t], next_v)
    return out.to(rewards.dtype)


def rlops_gae(rewards, values, mask, gamma, lam, dones=None):
    return rlops.gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones)[0]


def float64_loop(rewards, values, mask, gamma, lam, dones=None):
    return serial_gae(rewards, values, mask, gamma, lam, dones).float()


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's advantages are whitened: compare its returns, less the values."""
    _, returns = verl.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    return (returns - values) * mask


def slime_gae(rewards, values, mask, gamma, lam):
    """slime's batch GAE takes no mask: padding is zeroed."""
    return slime.vanilla_gae(rewards * mask, values * mask, gamma, lam)[0]


def rlops_returns(rewards, mask, gamma, dones=None):
    return rlops.discounted_returns(rewards, gamma=gamma, mask=mask, dones=dones)


# --------------------------------------------------------------------------- broken ones
def bootstrap_from_last_value(rewards, values, mask, gamma, lam):
    """values: V after the row's end read as V[T - 1] rather than 0."""
    return serial_gae(rewards, values, mask, gamma, lam, bootstrap_last=True).float()


def mask_as_restart(rewards, values, mask, gamma, lam):
    """masks: each turn its own episode (the estimator restarts at tool output)."""
    return serial_gae(rewards, values, mask, gamma, lam, restart=True).float()


def dones_ignored(rewards, values, mask, gamma, lam, dones=None):
    """dones: takes dones= and ignores it (value leaks across packed sequences)."""
    return serial_gae(rewards, values, mask, gamma, lam, dones, ignore_dones=True).float()


def float16_accumulation(rewards, values, mask, gamma, lam):
    """long_rows: the carries held in float16."""
    return serial_gae(rewards, values, mask, gamma, lam, dtype=torch.float16).float()


def log_space_scan(rewards, values, mask, gamma, lam):
    """edges: A[t] = w^(−t) · Σ_{k≥t} w^k·δ[k], the powers in log space: log 0 at γλ = 0."""
    v_next = torch.cat([values[:, 1:] * mask[:, 1:], values.new_zeros(values.shape[0], 1)], 1)
    delta = (rewards + gamma * v_next - values) * mask
    t = torch.arange(rewards.shape[1], dtype=torch.float64)
    log_w = torch.log(torch.tensor(gamma * lam, dtype=torch.float64))
    scaled = delta.double() * torch.exp(t * log_w)
    tail = scaled.flip(-1).cumsum(-1).flip(-1)
    return (tail * torch.exp(-t * log_w) * mask).float()


BROKEN = {
    "values": bootstrap_from_last_value,
    "masks": mask_as_restart,
    "dones": dones_ignored,
    "long_rows": float16_accumulation,
    "edges": log_space_scan,
}


def test_every_check_has_a_broken_implementation():
    assert list(BROKEN) == list(ADVANTAGE_CHECKS)


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_check_catches_its_bug(name):
    report = check_advantages(BROKEN[name], **QUICK)
    print(report)
    assert name in report.failed, str(report)
    if name == "masks":
        assert "semantics: restart" in report["masks"].figure, str(report)


def test_rlops_passes_at_the_defaults():
    report = check_advantages(rlops_gae)
    print(report)
    report.raise_if_failed()
    assert report["dones"].ok


@pytest.mark.parametrize("fn", [float64_loop, verl_gae], ids=lambda f: f.__name__)
def test_correct_implementations_pass(fn):
    report = check_advantages(fn, **QUICK)
    print(report)
    assert report, str(report)
    assert report["dones"].ok is (fn is float64_loop or None)


def test_slime_batch_gae_zeroes_masked_tokens():
    report = check_advantages(slime_gae, **QUICK)
    print(report)
    assert report.failed == ["masks"], str(report)
    assert "semantics: zero" in report["masks"].figure


def test_returns():
    report = check_advantages(rlops_returns, estimator="returns", **QUICK)
    print(report)
    assert report, str(report)
