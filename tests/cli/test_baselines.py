"""What ``rlops bench`` and ``rlops profile`` measure rlops against computes what rlops computes.

Each baseline in ``rlops.measure.baselines`` is compared with the rlops function it stands beside,
in float64 on random inputs of odd sizes. Tolerance: an ``n``-term float64 sum is within
``gamma_n * S`` of the exact sum, with ``gamma_n = n u / (1 - n u)``, ``u = 2**-53`` and ``S``
the sum of the terms' magnitudes (Higham, *Accuracy and Stability of Numerical Algorithms*,
§3.1); each term here passes through at most two more roundings (a product, a difference), so
two implementations that order the work differently differ by at most ``2 * gamma_{n+2} * S``,
computed per element. Exact agreement is not required: the chunk loop and rlops sum in other
orders than the per-token loop.
"""

from __future__ import annotations

import pytest
import torch

import rlops
from rlops.measure import baselines

F64 = torch.float64
U = torch.finfo(F64).eps / 2


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def assert_within(name: str, actual: torch.Tensor, expected: torch.Tensor, bound) -> None:
    diff = (actual - expected).abs()
    bound = torch.as_tensor(bound, dtype=F64).expand_as(diff)
    worst = int(torch.argmax(diff - bound))
    assert (diff <= bound).all(), (
        f"{name}: |difference| {diff.flatten()[worst]:.3g} exceeds the float64 rounding bound "
        f"{bound.flatten()[worst]:.3g}"
    )


def discounted_abs(x: torch.Tensor, w: float) -> torch.Tensor:
    """``S_t = sum_{k >= t} w^(k-t) |x_k|`` along the last dim (magnitudes for the bound)."""
    out, acc = torch.empty_like(x), torch.zeros_like(x[..., 0])
    for t in reversed(range(x.shape[-1])):
        acc = x[..., t].abs() + w * acc
        out[..., t] = acc
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SIZES = [(1, 1), (3, 7), (2, 129)]
GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]


@pytest.mark.parametrize(("gamma_", "lam"), GAMMA_LAM)
@pytest.mark.parametrize(("b", "t"), SIZES)
@pytest.mark.parametrize(
    "baseline",
    [baselines.gae_token_loop, lambda r, v, g, lam: baselines.gae_chunk_loop(r, v, g, lam, 16)],
    ids=["token loop", "chunk loop"],
)
def test_gae_loops_match_rlops_gae(baseline, b, t, gamma_, lam):
    g = gen(t)
    rewards, values = (
        torch.randn(b, t, generator=g, dtype=F64),
        torch.randn(b, t, generator=g, dtype=F64),
    )
    adv, ret = baseline(rewards, values, gamma_, lam)
    adv_ref, ret_ref = rlops.gae(rewards, values, gamma=gamma_, lam=lam)
    next_values = torch.cat([values[:, 1:], values.new_zeros(b, 1)], dim=1)
    terms = rewards.abs() + gamma_ * next_values.abs() + values.abs()  # |delta_t| before cancelling
    bound = 2 * gamma(t + 2) * discounted_abs(terms, gamma_ * lam)
    assert_within("advantages", adv, adv_ref, bound)
    assert_within("returns", ret, ret_ref, bound + 2 * U * values.abs())


@pytest.mark.parametrize("gamma_", [1.0, 0.9])
@pytest.mark.parametrize(("b", "t"), SIZES)
def test_returns_token_loop_matches_discounted_returns(b, t, gamma_):
    rewards = torch.randn(b, t, generator=gen(t), dtype=F64)
    out = torch.stack(baselines.returns_token_loop(list(rewards), gamma_))
    bound = 2 * gamma(t + 1) * discounted_abs(rewards, gamma_)
    assert_within("returns", out, rlops.discounted_returns(rewards, gamma=gamma_), bound)


@pytest.mark.parametrize(("b", "t"), [(1, 2), (3, 7), (2, 129)])
def test_masked_whiten_moments_matches_masked_whiten_on_selected_entries(b, t):
    """verl's form leaves values where the mask is 0; rlops gives 0 there: compare mask-1."""
    g = gen(t)
    x = 3.0 + 2.0 * torch.randn(b, t, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(F64)
    mask[0, :2] = 1  # at least two selected entries (one gives a variance of 0 / 0)
    n = int(mask.sum())
    selected = x[mask.bool()]
    std = selected.std()
    # the mean and the variance are n-term sums; the result is (x - mean) / std
    scale = (x.abs() + selected.abs().mean()) / std
    bound = 4 * gamma(n + 4) * (scale + selected.abs().sum() / (n * std))
    out = baselines.masked_whiten_moments(x, mask) * mask
    assert_within("whitened", out, rlops.masked_whiten(x, mask), bound * mask)


KINDS = [
    ("grpo", rlops.grpo_advantages),
    ("rloo", rlops.rloo_advantages),
    ("rfpp", rlops.reinforce_plus_plus_baseline_advantages),
]


@pytest.mark.parametrize(("kind", "ours"), KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.parametrize("n", [1, 7, 129])
def test_group_loop_matches_rlops_group_estimators(kind, ours, n):
    """Groups of one to many samples, ids not contiguous, a ragged mask over T = 5."""
    g = gen(n)
    scores = torch.randn(n, generator=g, dtype=F64)
    index = torch.randint(0, max(1, n // 3), (n,), generator=g) * 7919
    mask = (torch.rand(n, 5, generator=g) < 0.6).to(F64)
    mask[:, :2] = 1
    adv, _ = baselines.group_loop(scores, index.tolist(), mask, kind)
    adv_ref, _ = ours(scores, index, mask)
    # each advantage is (s - group mean) / (group std) at worst, for a group of at most n; the
    # REINFORCE++ baseline then whitens over all n * 5 tokens (a second such step)
    stds = [scores[index == i].std() for i in index.unique() if (index == i).sum() > 1]
    spread = min([s.item() for s in stds], default=1.0)
    mag = (scores.abs().max() + scores.abs().mean()) / min(spread, 1.0)
    steps = n + 4 if kind != "rfpp" else 2 * (5 * n + 4)
    bound = 4 * gamma(steps) * mag * (1 + adv_ref.abs()) * mask
    assert_within(kind, adv, adv_ref, bound)


@pytest.mark.parametrize(("b", "t"), SIZES)
def test_remax_flip_cumsum_matches_remax_on_action_tokens(b, t):
    """verl's flip-cumsum leaves the reward-to-go on mask-0 tokens; rlops gives 0 there."""
    g = gen(t)
    rewards = torch.randn(b, t, generator=g, dtype=F64)
    base = torch.randn(b, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(F64)
    adv, ret = baselines.remax_flip_cumsum(rewards, base, mask)
    adv_ref, ret_ref = rlops.remax_advantages(rewards, base, mask)
    bound = 2 * gamma(t + 1) * discounted_abs(rewards * mask, 1.0) * mask
    assert_within("returns", ret * mask, ret_ref, bound)
    assert_within(
        "advantages", adv * mask, adv_ref, bound + 2 * U * (ret_ref.abs() + base.abs()[:, None])
    )


@pytest.mark.parametrize("v", [1, 7, 129])
def test_logprobs_entropy_unfused_matches_fused(v):
    g = gen(v)
    logits = 4.0 * torch.randn(11, v, generator=g, dtype=F64)
    target = torch.randint(0, v, (11,), generator=g)
    logp, ent = baselines.logprobs_entropy_unfused(logits, target)
    logp_ref, ent_ref = rlops.logprobs_and_entropy(logits, target)
    # log-sum-exp of v terms, then z_target - lse and lse - sum(p * z): each a v-term sum of
    # magnitude at most max|z| + log v
    mag = logits.abs().amax(dim=-1) + torch.log(torch.tensor(float(v), dtype=F64)) + 1
    bound = 4 * gamma(v + 4) * mag
    assert_within("log-probs", logp, logp_ref, bound)
    assert_within("entropy", ent, ent_ref, bound)
