"""Group estimators against per-sample loops written from the formulas (verl's conventions)."""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask

from rlops.group_advantages import (
    _dense_group_ids,
    grpo_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlops.stats import masked_whiten


def make_batch(dtype, seed, b=23, t=17):
    """Scores, arbitrary non-contiguous group ids (groups of 1..5, two singletons), mask."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [4, 1, 5, 3, 1, 2, 4, 3]
    ids = torch.tensor([10**12, -7, 3, 42, 0, 5, -(2**40), 99])
    index = torch.repeat_interleave(ids, torch.tensor(sizes))
    index = index[torch.randperm(b, generator=gen)]
    scores = torch.randn(b, generator=gen, dtype=torch.float64).mul(2).add(0.3).to(dtype)
    return scores, index, random_mask(b, t, gen)


# --------------------------------------------------------------------------- references
def groups_of(index):
    g = defaultdict(list)
    for i, k in enumerate(index.tolist()):
        g[k].append(i)
    return g


def ref_group_scalars(scores, index, kind, dtype, exact=False, eps=1e-6):
    """Per-sample advantage from a loop over groups; ``exact`` uses rational arithmetic."""
    out = [0.0] * scores.shape[0]
    vals = [Fraction(float(v)) for v in scores] if exact else scores.to(dtype)
    for members in groups_of(index).values():
        n = len(members)
        g = [vals[i] for i in members]
        if exact:
            mean = sum(g, Fraction(0)) / n
            std = math.sqrt(float(sum(((v - mean) ** 2 for v in g), Fraction(0)) / max(n - 1, 1)))
        else:
            stacked = torch.stack(g)
            mean, std = stacked.mean(), (stacked.std() if n > 1 else None)
        for i in members:
            s = vals[i]
            if n == 1:  # verl: mean 0, std 1
                a = {"grpo": s / (1 + eps), "drgrpo": s, "rloo": s, "rfpp": s}[kind]
            elif kind == "grpo":
                a = (float(s - mean) / (std + eps)) if exact else (s - mean) / (std + eps)
            elif kind == "rloo":  # leave-one-out mean of the others, as in the paper
                others = sum((vals[j] for j in members if j != i), 0 * s) / (n - 1)
                a = s - others
            else:
                a = s - mean
            out[i] = float(a)
    return torch.tensor(out, dtype=torch.float64)


def ref_whiten_tokens(a, mask, exact, dtype, eps=1e-8):
    """verl's masked_whiten of the broadcast advantages, over all mask-1 tokens."""
    vals = [(a[i], int(mask[i].sum())) for i in range(a.shape[0])]
    if exact:
        q = [(Fraction(float(v)), k) for v, k in vals]
        n = sum(k for _, k in q)
        mean = sum((v * k for v, k in q), Fraction(0)) / n
        var = sum(((v - mean) ** 2 * k for v, k in q), Fraction(0)) / (n - 1)
        inv = 1 / math.sqrt(float(var + Fraction(eps)))
        w = [float(v - mean) * inv for v, _ in q]
        return torch.tensor(w, dtype=torch.float64)[:, None] * mask
    tok = a.to(dtype)[:, None].expand(mask.shape)[mask.bool()]
    mean, var = tok.mean(), tok.var()
    return ((a.to(dtype) - mean) / torch.sqrt(var + eps))[:, None] * mask


def broadcast(a, mask):
    return a[:, None] * mask


# --------------------------------------------------------------------------- estimators
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_match_loop_reference(kind, dtype, seed):
    scores, index, mask = make_batch(dtype, seed)
    acc = acc_dtype(dtype)
    if kind == "rloo":
        adv, ret = rloo_advantages(scores, index, mask)
    else:
        adv, ret = grpo_advantages(scores, index, mask, norm_std=kind == "grpo")
    assert adv.dtype == dtype and adv.shape == mask.shape and ret is adv
    assert (adv[mask == 0] == 0).all() and (adv[0] == 0).all()  # row 0 has no action token
    exact = broadcast(ref_group_scalars(scores, index, kind, None, exact=True), mask)
    same = broadcast(ref_group_scalars(scores, index, kind, acc).to(dtype), mask)
    assert_within_ref_error(adv, exact, same)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_level_scores_are_summed_over_t(dtype):
    scores, index, mask = make_batch(dtype, 2)
    token = torch.zeros(mask.shape, dtype=dtype)
    token[:, -1] = scores  # the outcome reward sits on the last position
    for fn in (grpo_advantages, rloo_advantages, reinforce_plus_plus_baseline_advantages):
        assert torch.equal(fn(token, index, mask)[0], fn(scores, index, mask)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_plus_plus_baseline_matches_loop_reference(dtype, seed):
    scores, index, mask = make_batch(dtype, seed)
    adv, ret = reinforce_plus_plus_baseline_advantages(scores, index, mask)
    assert adv.dtype == dtype and ret is adv and (adv[mask == 0] == 0).all()
    acc = acc_dtype(dtype)
    a_exact = ref_group_scalars(scores, index, "rfpp", None, exact=True)
    a_same = ref_group_scalars(scores, index, "rfpp", acc)
    exact = ref_whiten_tokens(a_exact, mask, True, None)
    assert_within_ref_error(adv, exact, ref_whiten_tokens(a_same, mask, False, acc))
    # Same as whitening the broadcast [B, T] values token by token.
    a = torch.where(mask.bool(), a_same.to(acc)[:, None], 0)
    torch.testing.assert_close(adv, masked_whiten(a, mask).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outcome", [False, True])
def test_remax_matches_loop_reference(dtype, outcome):
    gen = torch.Generator().manual_seed(4)
    b, t = 7, 19
    mask = random_mask(b, t, gen)
    base = torch.randn(b, generator=gen, dtype=torch.float64).to(dtype)
    r = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    if outcome:  # [B] outcome rewards: the reward-to-go is the score on every action token
        r = r[:, 0]
    adv, ret = remax_advantages(r, base, mask)
    assert adv.dtype == ret.dtype == dtype
    if outcome:  # the same as the score placed on the last action token
        last = torch.arange(t).expand(b, t).masked_fill(mask == 0, -1).max(-1).values
        r = torch.zeros(b, t, dtype=dtype).index_put((torch.arange(b), last), r)
        r = r * (last >= 0)[:, None]

    def loop(acc, exact):
        """Undiscounted reward-to-go over the action tokens, then minus the baseline."""
        rets = torch.zeros(b, t, dtype=torch.float64)
        for i in range(b):
            run = Fraction(0) if exact else torch.zeros((), dtype=acc)
            for j in reversed(range(t)):
                if mask[i, j]:
                    run = run + (Fraction(float(r[i, j])) if exact else r[i, j].to(acc))
                    rets[i, j] = float(run)
        if not exact:
            rets = rets.to(acc).to(dtype).double()
        base_d = base.double()
        advs = torch.where(mask.bool(), rets - base_d[:, None], 0)
        return rets, advs if exact else advs.to(acc).to(dtype)

    ret_exact, adv_exact = loop(None, True)
    ret_same, adv_same = loop(acc_dtype(dtype), False)
    assert_within_ref_error(ret, ret_exact, ret_same)
    assert_within_ref_error(adv, adv_exact, adv_same)


def test_bool_int_and_float_masks_agree():
    scores, index, mask = make_batch(torch.float32, 5)
    rewards = torch.randn(mask.shape)
    for fn, args in (
        (grpo_advantages, (scores, index)),
        (rloo_advantages, (scores, index)),
        (reinforce_plus_plus_baseline_advantages, (scores, index)),
        (remax_advantages, (rewards, scores)),
    ):
        outs = [fn(*args, m) for m in (mask, mask.bool(), mask.float(), mask.double())]
        for out in outs[1:]:
            assert all(torch.equal(x, y) for x, y in zip(out, outs[0], strict=True)), fn


# --------------------------------------------------------------------------- identities
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.1, 1.0, -3.7, 1e6 + 0.3])
def test_grpo_one_group_of_equal_scores_gives_zeros(dtype, value):
    scores = torch.full((7,), value, dtype=dtype)
    index, mask = torch.full((7,), 5), torch.ones(7, 3)
    for norm_std, eps in ((True, 1e-6), (True, 0.0), (False, 1e-6)):
        adv, _ = grpo_advantages(scores, index, mask, norm_std=norm_std, eps=eps)
        assert (adv == 0).all()
    assert (rloo_advantages(scores, index, mask)[0] == 0).all()
    for eps in (1e-8, 0.0):
        adv, _ = reinforce_plus_plus_baseline_advantages(scores, index, mask, eps=eps)
        assert (adv == 0).all()


def test_rloo_equals_scaled_centred_score_and_grpo_without_std():
    scores, index, mask = make_batch(torch.float64, 3)
    dr, _ = grpo_advantages(scores, index, mask, norm_std=False)
    rloo, _ = rloo_advantages(scores, index, mask)
    n = torch.tensor([len(groups_of(index)[k]) for k in index.tolist()], dtype=torch.float64)
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1.0)[:, None]
    torch.testing.assert_close(rloo, scale * dr, rtol=1e-14, atol=1e-14)


def test_groups_of_one_follow_verl():
    scores = torch.tensor([2.0, -1.0, 3.0, 5.0])
    index, mask = torch.tensor([1, 2, 2, 3]), torch.ones(4, 1)
    adv, _ = grpo_advantages(scores, index, mask, eps=0.5)
    assert adv[0, 0] == 2.0 / 1.5 and adv[3, 0] == 5.0 / 1.5  # mean 0, std 1, then + eps
    assert grpo_advantages(scores, index, mask, norm_std=False)[0][0, 0] == 2.0
    assert rloo_advantages(scores, index, mask)[0][3, 0] == 5.0


def test_dense_group_ids_preserve_the_partition():
    gen = torch.Generator().manual_seed(9)
    index = torch.randint(-(2**62), 2**62, (6,), generator=gen)[torch.randint(0, 6, (200,))]
    dense = _dense_group_ids(index)
    assert dense.min() == 0 and dense.max() == len(set(index.tolist())) - 1
    same = index[:, None] == index[None, :]
    assert torch.equal(same, dense[:, None] == dense[None, :])
    assert _dense_group_ids(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_empty_batch():
    empty = torch.zeros(0)
    for fn in (grpo_advantages, rloo_advantages, reinforce_plus_plus_baseline_advantages):
        adv, _ = fn(empty, torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))
        assert adv.shape == (0, 4)


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    s, idx, m = torch.randn(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    with pytest.raises(TypeError, match="scores"):
        grpo_advantages(torch.ones(4, dtype=torch.long), idx, m)
    with pytest.raises(TypeError, match="index"):
        grpo_advantages(s, idx.float(), m)
    with pytest.raises(TypeError, match="index"):
        rloo_advantages(s, [0, 0, 1, 1], m)
    with pytest.raises(ValueError, match="index"):
        rloo_advantages(s, idx[:3], m)
    with pytest.raises(ValueError, match="scores"):
        grpo_advantages(torch.randn(5), idx, m)
    with pytest.raises(ValueError, match="mask"):
        grpo_advantages(s, idx, torch.ones(4))
    with pytest.raises(ValueError, match="mask"):
        reinforce_plus_plus_baseline_advantages(s, idx, torch.full((4, 3), 3.0))
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(s, idx, m, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        reinforce_plus_plus_baseline_advantages(s, idx, m, eps=float("nan"))
    with pytest.raises(ValueError, match="reward_baselines"):
        remax_advantages(torch.randn(4, 3), torch.randn(3), m)
    with pytest.raises(ValueError, match="rewards"):
        remax_advantages(torch.randn(4, 2), torch.randn(4), m)
    with pytest.raises(TypeError, match="reward_baselines"):
        remax_advantages(torch.randn(4, 3), torch.ones(4, dtype=torch.long), m)


# --------------------------------------------------------------------------- accuracy, range
def plain_group_loop(scores, index, kind):
    """A per-group two-pass loop in the scores' own dtype (what trainers ship)."""
    out = torch.empty_like(scores)
    for idx in groups_of(index).values():
        s = scores[idx]
        n = len(idx)
        mean = s.sum() / n
        c = s - mean
        if kind == "rloo":
            out[idx] = c * n / (n - 1) if n > 1 else s
        else:
            std = torch.sqrt((c * c).sum() / (n - 1)) if n > 1 else torch.ones_like(mean)
            out[idx] = (c if n > 1 else s) / (std + 1e-6)
    return out


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float32_group_statistics_at_least_as_accurate_as_a_plain_loop(kind, seed):
    """512 samples in groups of 10 and 2 (verl's RLOO test): float32 error against float64 no
    larger than a plain two-pass loop's in float32."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([10] * 40 + [2] * 56)
    index = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    index = index[torch.randperm(len(index), generator=gen)]
    scores = torch.randn(len(index), generator=gen, dtype=torch.float64).mul(3).add(5)
    mask = torch.ones(len(index), 3)
    fn = rloo_advantages if kind == "rloo" else grpo_advantages
    exact = plain_group_loop(scores, index, kind)
    ours = fn(scores.float(), index, mask)[0][:, 0].double()
    loop = plain_group_loop(scores.float(), index, kind).double()
    err, loop_err = (ours - exact).abs().max(), (loop - exact).abs().max()
    rounding = torch.finfo(torch.float32).eps * exact.abs().max() / 2  # the output's own rounding
    assert err <= loop_err + rounding, (float(err), float(loop_err))


@pytest.mark.parametrize(
    ("dtype", "magnitude"), [(torch.float32, 1e30), (torch.float32, 3e38), (torch.float64, 1e200)]
)
def test_huge_finite_scores_give_finite_correct_advantages(dtype, magnitude):
    gen = torch.Generator().manual_seed(5)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    base = torch.rand(10, generator=gen, dtype=torch.float64) * 2 - 1
    scores = (base * magnitude).to(dtype)
    mask = torch.ones(10, 2)
    # the definition on unit-scaled scores: GRPO is scale-invariant (eps negligible), RLOO linear
    unit = scores.double() / magnitude
    for fn, kind, scaled in ((grpo_advantages, "grpo", 1.0), (rloo_advantages, "rloo", magnitude)):
        out = fn(scores, index, mask)[0][:, 0]
        assert torch.isfinite(out).all(), kind
        expected = plain_group_loop(unit, index, kind) * scaled
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)
