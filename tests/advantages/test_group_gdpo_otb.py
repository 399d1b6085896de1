"""GDPO and the optimal token baseline (``rlops.group_advantages``) against float64 loops that
restate the papers' formulas and verl's ``compute_gdpo_outcome_advantage``,
``compute_optimal_token_baseline_advantage`` and its multi-turn (TIR) form."""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import assert_within_reference

from rlops.group_advantages import gdpo_advantages, optimal_token_baseline_advantages


def _groups(index):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(index.tolist()):
        out.setdefault(g, []).append(i)
    return out


def ref_gdpo(scores, index, mask, weights, norm_std, eps=1e-6):
    b, k = scores.shape
    total = torch.zeros(b, dtype=scores.dtype)
    for j in range(k):
        for rows in _groups(index).values():
            s = scores[rows, j].double()
            if len(rows) == 1:
                mu, sd = 0.0, 1.0
            else:
                mu, sd = s.mean(), s.std()
            a = (s - mu) / (sd + eps) if norm_std else s - mu
            total[rows] += weights[j] * a
    x = total[:, None].expand(mask.shape)[mask.bool()]
    mean, var = x.mean(), x.var()
    out = (total - mean) * torch.rsqrt(var + 1e-8)
    return torch.where(mask.bool(), out[:, None], 0).to(scores.dtype)


@pytest.mark.parametrize("norm_std", [True, False])
def test_gdpo_matches_verl_formula(norm_std):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(9, 3, generator=g, dtype=torch.float64)
    scores[:, 2] *= 50  # a component of large spread does not drown the others
    index = torch.tensor([4, 4, 4, 1, 1, 7, 2, 2, 2])
    mask = torch.rand(9, 6, generator=g) < 0.8
    weights = [1.0, 0.5, 2.0]
    adv, ret = gdpo_advantages(scores, index, mask, weights=weights, norm_std=norm_std)
    torch.testing.assert_close(adv, ref_gdpo(scores, index, mask, weights, norm_std))
    assert adv is ret


def ref_otb(rewards, index, mask, logp, spp, isw, zero_tail, eps, tir):
    """verl's two OTB estimators restated as loops, in the inputs' dtype."""
    b, t = rewards.shape
    dt = rewards.dtype
    m = mask.to(dt)
    ret = (rewards * m).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(logp) + spp
    if isw is not None:
        w = w * isw**2
    wc = (w * m).cumsum(-1)
    lengths = [int(mask[i].sum()) for i in range(b)]
    if tir:  # compact every row's action tokens to the front
        gv = torch.zeros(b, t, dtype=dt)
        wv = torch.zeros(b, t, dtype=dt)
        live = torch.zeros(b, t, dtype=dt)
        for i in range(b):
            sel = mask[i].bool()
            gv[i, : lengths[i]] = ret[i, sel]
            wv[i, : lengths[i]] = wc[i, sel]
            live[i, : lengths[i]] = 1
        members = {g: [i for i in rows if lengths[i] > 0] for g, rows in _groups(index).items()}
    else:
        gv, wv, live, members = ret, wc, m, _groups(index)
    base = torch.zeros(b, t, dtype=dt)
    for rows in members.values():
        if len(rows) <= 1:
            continue
        num = (gv[rows] * wv[rows] * live[rows]).sum(0)
        den = (wv[rows] * live[rows]).sum(0) + eps
        base[rows] = num / den
        if zero_tail:
            ls = sorted(lengths[i] for i in rows)
            longest = [i for i in rows if lengths[i] == ls[-1]]
            if len(longest) == 1 and ls[-1] > ls[-2]:
                base[longest[0], ls[-2] :] = 0
    adv_c = gv - base
    if tir:
        adv = torch.zeros(b, t, dtype=dt)
        for i in range(b):
            adv[i, mask[i].bool()] = adv_c[i, : lengths[i]]
    else:
        adv = adv_c * m
    return adv, ret * m


@pytest.mark.parametrize("tir", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_otb_matches_verl_formula(tir, zero_tail, with_is):
    g = torch.Generator().manual_seed(3)
    b, t = 10, 12
    index = torch.tensor([0, 0, 0, 0, 5, 5, 9, 2, 2, 2])
    lengths = torch.tensor([12, 7, 7, 3, 5, 9, 4, 0, 6, 2])
    mask = torch.arange(t)[None] < lengths[:, None]
    if tir:  # tool spans inside the rows
        mask[:, 2] = False
        mask[1, 5:7] = False
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * (torch.rand(b, t) < 0.3)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    spp = torch.rand(b, t, generator=g, dtype=torch.float64) * 0.5 + 0.1
    isw = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5 if with_is else None
    adv, ret = optimal_token_baseline_advantages(
        rewards,
        index,
        mask,
        logp,
        spp,
        rollout_is_weights=isw,
        handle_zero_tail=zero_tail,
        per_action_step=tir,
    )
    r_adv, r_ret = ref_otb(rewards, index, mask, logp, spp, isw, zero_tail, 1e-8, tir)
    torch.testing.assert_close(adv, r_adv)
    torch.testing.assert_close(ret, r_ret)


def test_otb_without_gaps_tir_equals_otb_and_equal_weights_give_the_group_mean():
    g = torch.Generator().manual_seed(5)
    r = torch.randn(6, 5, generator=g, dtype=torch.float64)
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 5)
    logp = torch.full((6, 5), -0.5, dtype=torch.float64)
    spp = torch.full((6, 5), 0.4, dtype=torch.float64)
    a1, _ = optimal_token_baseline_advantages(r, idx, mask, logp, spp, eps=0.0)
    a2, _ = optimal_token_baseline_advantages(
        r, idx, mask, logp, spp, eps=0.0, per_action_step=True
    )
    torch.testing.assert_close(a1, a2)
    ret = r.flip(-1).cumsum(-1).flip(-1)
    mean = torch.cat(
        [ret[:3].mean(0, keepdim=True).expand(3, 5), ret[3:].mean(0, keepdim=True).expand(3, 5)]
    )
    torch.testing.assert_close(a1, ret - mean)


@pytest.mark.parametrize("tir", [False, True])
def test_float32_error_at_most_twice_the_float32_loops(tir):
    """Against float64, rlops in float32 is within twice the error of verl's loops run in
    float32 (GDPO and OTB: long rows, rewards of mixed scale)."""
    g = torch.Generator().manual_seed(12)
    b, t = 16, 700
    index = torch.arange(b) // 4
    mask = torch.arange(t)[None] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    if tir:
        mask &= torch.rand(b, t, generator=g) < 0.8
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * (torch.rand(b, t) < 0.05)
    rewards[:, -1] += 1e3 * torch.rand(b, generator=g, dtype=torch.float64)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    spp = torch.rand(b, t, generator=g, dtype=torch.float64) * 0.5
    args64 = (rewards, index, mask, logp, spp)
    args32 = (rewards.float(), index, mask, logp.float(), spp.float())
    oracle, _ = ref_otb(rewards, index, mask, logp, spp, None, True, 1e-8, tir)
    loop32, _ = ref_otb(
        rewards.float(), index, mask, logp.float(), spp.float(), None, True, 1e-8, tir
    )
    out, _ = optimal_token_baseline_advantages(*args32, per_action_step=tir)
    assert_within_reference("otb", out, oracle, loop32)
    torch.testing.assert_close(
        optimal_token_baseline_advantages(*args64, per_action_step=tir)[0], oracle
    )
    scores = torch.randn(b, 3, generator=g, dtype=torch.float64) * torch.tensor([1, 1e3, 1e-3])
    oracle = ref_gdpo(scores, index, mask, [1.0, 1.0, 1.0], True)
    loop32 = ref_gdpo(scores.float(), index, mask, [1.0, 1.0, 1.0], True)
    out, _ = gdpo_advantages(scores.float(), index, mask)
    assert_within_reference("gdpo", out, oracle, loop32)
