"""MaxRL (``rlops.maxrl_advantages``): against prime-rl's ``MaxRLAlgorithm.score_group`` and
SkyRL's ``compute_maxrl_advantage`` (both copied below), against the plain loop of
``rlops.advantages.reference`` and an exact rational oracle in float32 / bfloat16 / float64 on
odd sizes, by hand, at the edges, under autograd, and on bad input."""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest
import torch
from tests._bad_input import names
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask

import rlops
from rlops.advantages.reference import maxrl_reference


# --------------------------------------------------------------------------- the peers' code
# PrimeIntellect-ai/prime-rl src/prime_rl/orchestrator/algo/max_rl.py at commit
# 559b44772e471d1538537b8805cc77f3824a5e64: MaxRLAlgorithm.score_group's body verbatim.
# Adapted: a trace is a small object with a reward, a 0/1 mask and the advantage it is given;
# iter_trainable_traces (algo/base.py) keeps the traces with a sampled token (`any(mask)`),
# assign_advantages (algo/routing.py) stores the scalar; the rewards tensor is float64 (not
# float32) so that the comparison measures the formula, not float32 rounding.
class _Trace:
    def __init__(self, reward: float, mask: list[int]):
        self.reward, self.mask, self.advantage = reward, mask, 0.0


def _iter_trainable_traces(group):
    return [trace for trace in group if any(trace.mask)]


def _assign_advantages(trace, advantage):
    trace.advantage = advantage


def prime_rl_score_group(group: list[_Trace]) -> None:
    traces = _iter_trainable_traces(group)
    rewards = torch.tensor([trace.reward for trace in traces], dtype=torch.float64)
    mean = rewards.mean()
    advantages = torch.zeros_like(rewards) if mean <= 0 else (rewards - mean) / mean
    for trace, advantage in zip(traces, advantages.tolist(), strict=True):
        _assign_advantages(trace, advantage)


# NovaSky-AI/SkyRL skyrl/backends/skyrl_train/utils/ppo_utils.py at commit
# a9564572eb8e91076be43c1bd5e4615e3de17265: compute_maxrl_advantage verbatim (the registry
# decorator dropped).
def skyrl_compute_maxrl_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute advantage for MAXRL using mean-normalized group-relative rewards."""
    scores = token_level_rewards.sum(dim=-1)

    id2score = defaultdict(list)
    id2mean = {}

    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if len(id2score[index[i]]) > 1:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2mean[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask

    return scores, scores


# --------------------------------------------------------------------------- batches
def _batch(b: int, t: int, seed: int, binary: bool):
    """Non-negative scores (0/1, or continuous with exact zeros), groups of 1..6 with
    arbitrary ids, a ragged mask with empty rows (row 0 and a few more), some groups whose
    scores are all 0."""
    gen = torch.Generator().manual_seed(seed)
    sizes: list[int] = []
    while sum(sizes) < b:
        sizes.append(int(torch.randint(1, 7, (1,), generator=gen)))
    sizes[-1] -= sum(sizes) - b
    ids = torch.randperm(len(sizes), generator=gen) * 7 - 30
    index = torch.repeat_interleave(ids, torch.tensor(sizes))[torch.randperm(b, generator=gen)]
    if binary:
        scores = (torch.rand(b, generator=gen) < 0.3).double()
    else:
        scores = torch.rand(b, generator=gen, dtype=torch.float64) * 2
        scores[torch.rand(b, generator=gen) < 0.3] = 0.0
    scores[index == ids[0]] = 0.0  # a group without success
    mask = random_mask(b, t, gen)
    mask[torch.rand(b, generator=gen) < 0.15] = 0
    return scores, index, mask


WORST: dict[str, float] = {}


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("b,seed", [(1, 0), (7, 1), (64, 2), (129, 3), (1000, 4)])
def test_matches_skyrl(b, seed, binary):
    """eps = 1e-6 is SkyRL's estimator, rows with and without action tokens alike."""
    scores, index, mask = _batch(b, 13, seed, binary)
    token = torch.zeros(mask.shape, dtype=torch.float64)
    token[:, 0] = scores
    want, _ = skyrl_compute_maxrl_advantage(token, mask.double(), index.numpy(), 1e-6)
    adv, ret = rlops.maxrl_advantages(scores, index, mask, eps=1e-6)
    assert ret is adv and adv.dtype == torch.float64
    diff = float((adv - want).abs().max())
    WORST["skyrl"] = max(WORST.get("skyrl", 0.0), diff)
    assert diff <= 1e-12 * max(1.0, float(want.abs().max())), diff


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("b,seed", [(1, 5), (7, 6), (64, 7), (129, 8), (1000, 9)])
def test_matches_prime_rl(b, seed, binary):
    """eps = 0 is prime-rl's estimator once its rows without an action token are given ids
    of their own (prime-rl leaves them out of the group); a group left with one member is
    the documented difference: prime-rl gives it 0, rlops its score."""
    scores, index, mask = _batch(b, 13, seed, binary)
    traces = [_Trace(float(s), row.tolist()) for s, row in zip(scores, mask, strict=True)]
    groups = defaultdict(list)
    for i, k in enumerate(index.tolist()):
        groups[k].append(traces[i])
    for group in groups.values():
        prime_rl_score_group(group)
    want = torch.tensor([tr.advantage for tr in traces], dtype=torch.float64)
    empty = mask.sum(-1) == 0
    own = torch.where(empty, index.max() + 1 + torch.arange(b), index)
    adv, _ = rlops.maxrl_advantages(scores, own, mask)
    members = {k: sum(1 for tr in g if any(tr.mask)) for k, g in groups.items()}
    alone = torch.tensor([members[k] == 1 for k in index.tolist()]) & ~empty
    want = torch.where(alone, scores, want)  # the one documented difference
    want = want[:, None] * mask
    diff = float((adv - want).abs().max())
    WORST["prime-rl"] = max(WORST.get("prime-rl", 0.0), diff)
    assert diff <= 1e-12 * max(1.0, float(want.abs().max())), diff


def test_skyrl_divides_by_a_negative_mean_rlops_and_prime_rl_give_zero():
    scores, index, mask = (
        torch.tensor([-1.0, 0.5, 2.0, 3.0]),
        torch.tensor([0, 0, 1, 1]),
        torch.ones(4, 2),
    )
    token = torch.zeros(4, 2, dtype=torch.float64)
    token[:, 1] = scores.double()
    skyrl, _ = skyrl_compute_maxrl_advantage(token, mask.double(), index.numpy(), 1e-6)
    adv, _ = rlops.maxrl_advantages(scores, index, mask, eps=1e-6)
    # below the mean, yet (−1 + 0.25)/(−0.25 + 1e-6) ≈ +3: the sign flips
    assert float(skyrl[0, 0]) > 2.9 and float(skyrl[1, 0]) < -2.9
    assert torch.equal(adv[:2], torch.zeros(2, 2))
    torch.testing.assert_close(adv[2:].double(), skyrl[2:], rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- the reference
def _exact(scores, index, mask, eps):
    """Rational arithmetic, rounded once to float64."""
    out = [Fraction(0)] * scores.shape[0]
    vals = [Fraction(float(v)) for v in scores]
    groups = defaultdict(list)
    for i, k in enumerate(index.tolist()):
        groups[k].append(i)
    for rows in groups.values():
        mean = sum((vals[i] for i in rows), Fraction(0)) / len(rows)
        for i in rows:
            if len(rows) == 1:
                out[i] = vals[i]
            elif mean > 0:
                out[i] = (vals[i] - mean) / (mean + Fraction(eps))
    a = torch.tensor([float(v) for v in out], dtype=torch.float64)
    return a[:, None] * mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_matches_reference_and_exact_oracle(dtype, b, eps):
    scores, index, mask = _batch(b, 9, b, binary=False)
    scores = scores.to(dtype)
    adv, _ = rlops.maxrl_advantages(scores, index, mask, eps=eps)
    assert adv.dtype == dtype and adv.shape == mask.shape
    assert (adv[mask == 0] == 0).all()
    same = maxrl_reference(scores.to(acc_dtype(dtype)), index, mask, eps).to(dtype)
    assert_within_ref_error(adv, _exact(scores, index, mask, eps), same)


# --------------------------------------------------------------------------- by hand, edges
def test_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 2.5, 1.0, 1.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4])
    adv, _ = rlops.maxrl_advantages(scores, index, torch.ones(11, 1))
    want = [3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 2.5, 0.0, 0.0]
    assert adv[:, 0].tolist() == want  # rate 1/4; all pass; none pass; alone; all pass


def test_eps_is_added_to_the_mean():
    adv, _ = rlops.maxrl_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1), eps=1.5
    )
    assert adv[:, 0].tolist() == [0.25, -0.25]  # ±0.5 / (0.5 + 1.5)


def test_token_level_scores_are_summed_and_masks_of_any_dtype_agree():
    scores, index, mask = _batch(23, 7, 11, binary=False)
    token = torch.zeros(mask.shape, dtype=torch.float64)
    token[:, -1] = scores
    first = rlops.maxrl_advantages(scores, index, mask)[0]
    assert torch.equal(rlops.maxrl_advantages(token, index, mask)[0], first)
    for m in (mask.bool(), mask.float(), mask.double()):
        assert torch.equal(rlops.maxrl_advantages(scores, index, m)[0], first)


def test_empty_batch_and_meta_tensors_need_no_host_read():
    adv, _ = rlops.maxrl_advantages(
        torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.ones(0, 3)
    )
    assert adv.shape == (0, 3)
    scores = torch.empty(8, device="meta", requires_grad=True)
    adv, _ = rlops.maxrl_advantages(
        scores, torch.empty(8, dtype=torch.long, device="meta"), torch.empty(8, 5, device="meta")
    )
    assert adv.shape == (8, 5) and adv.device.type == "meta"
    adv.sum().backward()


def test_gradient_is_finite_and_matches_gradcheck():
    """The branches not taken (μ ≤ 0, groups of one) put no NaN into the gradient."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    scores.requires_grad_(True)
    index = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    mask = torch.ones(7, 2, dtype=torch.bool)
    adv, _ = rlops.maxrl_advantages(scores, index, mask)
    adv.sum().backward()
    assert bool(torch.isfinite(scores.grad).all())
    x = torch.tensor([1.0, 0.3, 0.7, 2.0, 0.4], dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 0, 0, 1, 1])
    assert torch.autograd.gradcheck(
        lambda s: rlops.maxrl_advantages(s, idx, torch.ones(5, 2), eps=1e-3)[0], (x,)
    )


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    s, idx, m = torch.rand(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    with pytest.raises(TypeError, match=names("scores")):
        rlops.maxrl_advantages(torch.ones(4, dtype=torch.long), idx, m)
    with pytest.raises(ValueError, match=names("scores")):
        rlops.maxrl_advantages(torch.rand(5), idx, m)
    with pytest.raises(TypeError, match=names("index")):
        rlops.maxrl_advantages(s, idx.float(), m)
    with pytest.raises(ValueError, match=names("index")):
        rlops.maxrl_advantages(s, idx[:3], m)
    with pytest.raises(ValueError, match=names("mask")):
        rlops.maxrl_advantages(s, idx, torch.ones(4))
    with pytest.raises(ValueError, match=names("mask")):
        rlops.maxrl_advantages(s, idx, torch.full((4, 3), 2.0))
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=names("eps")):
            rlops.maxrl_advantages(s, idx, m, eps=eps)
    with pytest.raises(TypeError, match=names("eps")):
        rlops.maxrl_advantages(s, idx, m, eps="0")
