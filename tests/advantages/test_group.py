"""The group estimators (GRPO / Dr.GRPO, RLOO, REINFORCE++-baseline, ReMax, OPO, GPG, GRPO
pass@k, GDPO, the optimal token baseline) against per-group loops and float64 restatements of
verl's formulas; identities between them, hand-computed cases and edge cases. Bad input:
``test_group_bad_input.py``."""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask
from tests.tolerances import assert_within_reference

import rlops.advantages.group as ga
from rlops.advantages.group import (
    _dense_group_ids,
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlops.stats import masked_whiten

ESTIMATORS = (opo_advantages, gpg_advantages, grpo_passk_advantages)


def make_batch(dtype, seed, b=23, t=17):
    """Scores, arbitrary non-contiguous group ids (groups of 1..5, two singletons), mask."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [4, 1, 5, 3, 1, 2, 4, 3]
    ids = torch.tensor([10**12, -7, 3, 42, 0, 5, -(2**40), 99])
    index = torch.repeat_interleave(ids, torch.tensor(sizes))
    index = index[torch.randperm(b, generator=gen)]
    scores = torch.randn(b, generator=gen, dtype=torch.float64).mul(2).add(0.3).to(dtype)
    return scores, index, random_mask(b, t, gen)


def make_batch_with_zeros(dtype, seed, b=23, t=17, singletons=True):
    """Scores (a few exactly 0), arbitrary non-contiguous group ids, a mask whose row 0 is
    empty. Groups of 1..5 samples; ``singletons=False`` merges the groups of one."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [4, 1, 5, 3, 1, 2, 4, 3] if singletons else [4, 2, 5, 3, 2, 4, 3]
    ids = torch.tensor([10**12, -7, 3, 42, 0, 5, -(2**40), 99][: len(sizes)])
    index = torch.repeat_interleave(ids, torch.tensor(sizes))
    index = index[torch.randperm(b, generator=gen)]
    scores = torch.randn(b, generator=gen, dtype=torch.float64).mul(2).add(0.3)
    scores[torch.randperm(b, generator=gen)[:5]] = 0.0  # GPG counts the non-zero scores
    return scores.to(dtype), index, random_mask(b, t, gen)


# --------------------------------------------------------------------------- references
def groups_of(index):
    g = defaultdict(list)
    for i, k in enumerate(index.tolist()):
        g[k].append(i)
    return g


def broadcast(a, mask):
    return a[:, None] * mask


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


def ref_opo(scores, index, mask, exact, dtype):
    """b_g = Σ L_i·s_i / Σ L_i over the group (0 for a group of one), A_i = s_i − b_g."""
    lengths = [int(v) for v in mask.sum(-1)]
    vals = [Fraction(float(v)) for v in scores] if exact else scores.to(dtype)
    out = [0.0] * scores.shape[0]
    for members in groups_of(index).values():
        total = sum(lengths[i] for i in members)
        if len(members) == 1:
            base = 0
        elif total == 0:  # no action token in the whole group: every advantage is masked
            continue
        elif exact:
            base = sum((lengths[i] * vals[i] for i in members), Fraction(0)) / total
        else:  # as verl writes it
            ln = torch.tensor([lengths[i] for i in members], dtype=dtype)
            base = (ln * torch.stack([vals[i] for i in members])).sum() / ln.sum()
        for i in members:
            out[i] = float(vals[i] - base)
    return torch.tensor(out, dtype=torch.float64)


def ref_gpg(scores, index, exact, dtype, f_norm=1.0, alpha=None):
    """A_i = α·(s_i − mean_g)/f_norm, α = B / max(#non-zero scores, 1); mean 0 for one."""
    vals = [Fraction(float(v)) for v in scores] if exact else scores.to(dtype)
    b = scores.shape[0]
    if alpha is None:
        alpha = Fraction(b, max(sum(1 for v in scores.tolist() if v != 0), 1))
    alpha = Fraction(alpha) if exact else torch.tensor(float(alpha), dtype=dtype)
    fn = Fraction(f_norm) if exact else f_norm
    out = [0.0] * b
    for members in groups_of(index).values():
        n = len(members)
        zero = Fraction(0) if exact else torch.zeros((), dtype=dtype)
        mean = sum((vals[i] for i in members), zero) / n if n > 1 else 0
        for i in members:
            out[i] = float(alpha * (vals[i] - mean) / fn)
    return torch.tensor(out, dtype=torch.float64)


def ref_passk(scores, index, exact, dtype, norm_std=True, eps=1e-6):
    """Best sample of each group: (r_max − r_second)/(std + eps); everyone else 0."""
    vals = [Fraction(float(v)) for v in scores] if exact else scores.to(dtype)
    out = [0.0] * scores.shape[0]
    for members in groups_of(index).values():
        n = len(members)
        g = sorted(members, key=lambda i: float(vals[i]), reverse=True)
        lead = vals[g[0]] - vals[g[1]]  # 0 on a tie for the top
        if norm_std:
            if exact:
                mean = sum((vals[i] for i in members), Fraction(0)) / n
                var = sum(((vals[i] - mean) ** 2 for i in members), Fraction(0)) / (n - 1)
                lead = float(lead) / (math.sqrt(var) + eps)
            else:
                lead = lead / (torch.stack([vals[i] for i in members]).std() + eps)
        out[g[0]] = float(lead)
    return torch.tensor(out, dtype=torch.float64)


def ref_gdpo(scores, index, mask, weights, norm_std, eps=1e-6):
    b, k = scores.shape
    total = torch.zeros(b, dtype=scores.dtype)
    for j in range(k):
        for rows in groups_of(index).values():
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
        members = {g: [i for i in rows if lengths[i] > 0] for g, rows in groups_of(index).items()}
    else:
        gv, wv, live, members = ret, wc, m, groups_of(index)
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


# --------------------------------------------------------------------------- against the loops
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_matches_loop_reference(dtype, seed):
    scores, index, mask = make_batch_with_zeros(dtype, seed)
    adv, ret = opo_advantages(scores, index, mask)
    assert adv.dtype == dtype and adv.shape == mask.shape and ret is adv
    assert (adv[mask == 0] == 0).all() and (adv[0] == 0).all()
    exact = broadcast(ref_opo(scores, index, mask, True, None), mask)
    same = broadcast(ref_opo(scores, index, mask, False, acc_dtype(dtype)).to(dtype), mask)
    assert_within_ref_error(adv, exact, same)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("f_norm", "alpha"), [(1.0, None), (0.37, None), (2.0, 1.5)])
def test_gpg_matches_loop_reference(dtype, seed, f_norm, alpha):
    scores, index, mask = make_batch_with_zeros(dtype, seed)
    adv, ret = gpg_advantages(scores, index, mask, f_norm=f_norm, alpha=alpha)
    assert adv.dtype == dtype and adv.shape == mask.shape and ret is adv
    assert (adv[mask == 0] == 0).all()
    exact = broadcast(ref_gpg(scores, index, True, None, f_norm, alpha), mask)
    same = ref_gpg(scores, index, False, acc_dtype(dtype), f_norm, alpha)
    assert_within_ref_error(adv, exact, broadcast(same.to(dtype), mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_std", [True, False])
def test_passk_matches_loop_reference(dtype, seed, norm_std):
    scores, index, mask = make_batch_with_zeros(dtype, seed, singletons=False)
    adv, ret = grpo_passk_advantages(scores, index, mask, norm_std=norm_std)
    assert adv.dtype == dtype and adv.shape == mask.shape and ret is adv
    assert (adv[mask == 0] == 0).all()
    exact = broadcast(ref_passk(scores, index, True, None, norm_std), mask)
    same = ref_passk(scores, index, False, acc_dtype(dtype), norm_std)
    assert_within_ref_error(adv, exact, broadcast(same.to(dtype), mask))
    # one sample per group at most is non-zero (ties may leave a group with none)
    nonzero = (adv != 0).any(-1)
    for members in groups_of(index).values():
        assert int(nonzero[members].sum()) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [2, 63, 129, 500])
def test_odd_sizes_with_random_groups(dtype, b):
    """Random group sizes (2..9) on odd batch sizes, scores on a coarse grid (ties for the top)."""
    gen = torch.Generator().manual_seed(b)
    sizes = []
    while sum(sizes) < b:
        sizes.append(int(torch.randint(2, 10, (1,), generator=gen)))
    sizes[-1] -= sum(sizes) - b
    if sizes[-1] < 2:
        sizes[-2] += sizes.pop()
    index = torch.repeat_interleave(
        torch.randperm(len(sizes), generator=gen) * 3 - 50, torch.tensor(sizes)
    )[torch.randperm(b, generator=gen)]
    scores = (torch.randint(-4, 5, (b,), generator=gen) / 4).to(dtype)
    mask = random_mask(b, 9, gen)
    acc = acc_dtype(dtype)
    cases = (
        (opo_advantages, lambda e: ref_opo(scores, index, mask, e, None if e else acc)),
        (gpg_advantages, lambda e: ref_gpg(scores, index, e, None if e else acc)),
        (grpo_passk_advantages, lambda e: ref_passk(scores, index, e, None if e else acc)),
    )
    for fn, ref in cases:
        adv, _ = fn(scores, index, mask)
        same = broadcast(ref(False).to(dtype), mask)
        assert_within_ref_error(adv, broadcast(ref(True), mask), same)


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


# --------------------------------------------------------------------------- accuracy
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


@pytest.mark.parametrize("tir", [False, True])
def test_otb_float32_error_at_most_twice_the_float32_loops(tir):
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


# --------------------------------------------------------------------------- every estimator
def _batch(fn, dtype, seed):
    """The batch a shared test ran on for ``fn`` (the later estimators' has exact zeros)."""
    if fn in ESTIMATORS:
        return make_batch_with_zeros(dtype, seed, singletons=False)
    return make_batch(dtype, seed)


MEAN_STD = (grpo_advantages, rloo_advantages, reinforce_plus_plus_baseline_advantages)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", MEAN_STD + ESTIMATORS)
def test_token_level_scores_are_summed_over_t(fn, dtype):
    scores, index, mask = _batch(fn, dtype, 3 if fn in ESTIMATORS else 2)
    token = torch.zeros(mask.shape, dtype=dtype)
    token[:, -1] = scores  # the outcome reward sits on the last position
    assert torch.equal(fn(token, index, mask)[0], fn(scores, index, mask)[0])


@pytest.mark.parametrize("fn", (*MEAN_STD, remax_advantages, *ESTIMATORS))
def test_bool_int_and_float_masks_agree(fn):
    scores, index, mask = _batch(fn, torch.float32, 4 if fn in ESTIMATORS else 5)
    args = (torch.randn(mask.shape), scores) if fn is remax_advantages else (scores, index)
    outs = [fn(*args, m) for m in (mask, mask.bool(), mask.float(), mask.double())]
    for out in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(out, outs[0], strict=True)), fn


@pytest.mark.parametrize("fn", MEAN_STD + ESTIMATORS)
def test_empty_batch(fn):
    adv, _ = fn(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))
    assert adv.shape == (0, 4)


def test_groups_of_one_follow_verl():
    scores = torch.tensor([2.0, -1.0, 3.0, 5.0])
    index, mask = torch.tensor([1, 2, 2, 3]), torch.ones(4, 1)
    adv, _ = grpo_advantages(scores, index, mask, eps=0.5)
    assert adv[0, 0] == 2.0 / 1.5 and adv[3, 0] == 5.0 / 1.5  # mean 0, std 1, then + eps
    assert grpo_advantages(scores, index, mask, norm_std=False)[0][0, 0] == 2.0
    assert rloo_advantages(scores, index, mask)[0][3, 0] == 5.0
    assert opo_advantages(scores, index, mask)[0][0, 0] == 2.0  # baseline 0
    # α = 4/4 = 1; mean 0 for a group of one
    assert gpg_advantages(scores, index, mask)[0][3, 0] == 5.0
    with pytest.raises(ValueError, match="index"):  # verl raises for pass@k
        grpo_passk_advantages(scores, index, mask)


def test_passk_group_of_one_gets_zero_where_values_are_not_read(monkeypatch):
    monkeypatch.setattr(ga, "values_checked", lambda t: False)
    scores = torch.tensor([2.0, -1.0, 3.0, 5.0])
    adv, _ = grpo_passk_advantages(scores, torch.tensor([1, 2, 2, 3]), torch.ones(4, 1))
    assert torch.equal(adv[:, 0], torch.tensor([0.0, 0.0, 4.0 / (math.sqrt(8) + 1e-6), 0.0]))


@pytest.mark.parametrize("fn", ESTIMATORS)
def test_no_host_read_on_meta_tensors(fn):
    """Meta tensors have no values: forward and backward succeed only without a host read."""
    scores = torch.empty(8, device="meta", requires_grad=True)
    index = torch.empty(8, dtype=torch.long, device="meta")
    for mask in (
        torch.empty(8, 5, device="meta"),
        torch.empty(8, 5, dtype=torch.bool, device="meta"),
    ):
        adv, _ = fn(scores, index, mask)
        assert adv.shape == (8, 5) and adv.device.type == "meta"
        adv.sum().backward()


def test_dense_group_ids_preserve_the_partition():
    gen = torch.Generator().manual_seed(9)
    index = torch.randint(-(2**62), 2**62, (6,), generator=gen)[torch.randint(0, 6, (200,))]
    dense = _dense_group_ids(index)
    assert dense.min() == 0 and dense.max() == len(set(index.tolist())) - 1
    same = index[:, None] == index[None, :]
    assert torch.equal(same, dense[:, None] == dense[None, :])
    assert _dense_group_ids(torch.zeros(0, dtype=torch.long)).numel() == 0


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


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 3e38), (torch.float64, 1e300)])
def test_huge_finite_scores_stay_finite_in_opo_and_passk(dtype, magnitude):
    scores = torch.tensor([0.9, -0.7, 0.2, 0.5, -1.0, 0.3], dtype=torch.float64) * magnitude
    index, mask = torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, 4)
    mask[1, 2:] = 0
    unit = scores / magnitude
    opo = opo_advantages(scores.to(dtype), index, mask)[0]
    expected = broadcast(ref_opo(unit, index, mask, True, None), mask) * magnitude
    assert torch.isfinite(opo).all()
    torch.testing.assert_close(opo.double(), expected.to(dtype).double(), rtol=1e-5, atol=0)
    passk = grpo_passk_advantages(scores.to(dtype), index, mask)[0]
    assert torch.isfinite(passk).all()
    expected = broadcast(ref_passk(unit, index, True, None), mask)
    torch.testing.assert_close(passk.double(), expected, rtol=1e-5, atol=0)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opo_with_equal_lengths_is_dr_grpo(dtype):
    scores, index, _ = make_batch_with_zeros(dtype, 5)
    mask = torch.ones(scores.shape[0], 6)
    mask[:, 4:] = 0  # every row has 4 action tokens
    opo, _ = opo_advantages(scores, index, mask)
    dr, _ = grpo_advantages(scores, index, mask, norm_std=False)
    tol = 4 * torch.finfo(dtype).eps * float(scores.abs().max())
    torch.testing.assert_close(opo, dr, rtol=0, atol=tol)


def test_gpg_without_zero_scores_or_with_alpha_one_is_dr_grpo():
    scores, index, mask = make_batch_with_zeros(torch.float64, 6)
    dr, _ = grpo_advantages(scores, index, mask, norm_std=False)
    assert torch.equal(gpg_advantages(scores, index, mask, alpha=1.0)[0], dr)
    nonzero = scores + (scores == 0).double()
    torch.testing.assert_close(
        gpg_advantages(nonzero, index, mask)[0],
        grpo_advantages(nonzero, index, mask, norm_std=False)[0],
        rtol=1e-15,
        atol=1e-15,
    )


def test_passk_lead_of_a_pair_is_grpo_of_the_winner_scaled():
    """For groups of two, GRPO gives the winner (d/2)/(σ + eps) with σ = d/√2, pass@k d/(σ + eps):
    pass@k = 2·GRPO on the winner, 0 on the loser."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(20, generator=gen, dtype=torch.float64)
    index = torch.arange(10).repeat_interleave(2)
    mask = torch.ones(20, 3)
    passk, _ = grpo_passk_advantages(scores, index, mask, eps=0.0)
    grpo, _ = grpo_advantages(scores, index, mask, eps=0.0)
    torch.testing.assert_close(passk, torch.where(grpo > 0, 2 * grpo, 0.0), rtol=1e-14, atol=0)


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


# --------------------------------------------------------------------------- hand-computed
def test_opo_hand_computed():
    # group 7: scores 1, 0, 3 with lengths 2, 1, 1 -> b = (2·1 + 0 + 3)/4 = 1.25
    # group 2: scores 2, 6 with lengths 3, 1 -> b = (6 + 6)/4 = 3;  group 9: alone, keeps 5
    scores = torch.tensor([1.0, 0.0, 3.0, 2.0, 6.0, 5.0])
    index = torch.tensor([7, 7, 7, 2, 2, 9])
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [0, 0, 1], [1, 1, 1], [1, 0, 0], [0, 1, 0]], dtype=torch.bool
    )
    adv, _ = opo_advantages(scores, index, mask)
    per_row = torch.tensor([-0.25, -1.25, 1.75, -1.0, 3.0, 5.0])
    assert torch.equal(adv, torch.where(mask, per_row[:, None], 0.0))


def test_opo_group_without_action_tokens_and_equal_scores():
    scores = torch.tensor([0.1, 0.1, 0.1, 2.0, 4.0])
    index = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]])
    adv, _ = opo_advantages(scores, index, mask)
    assert (adv == 0).all() and torch.isfinite(adv).all()


def test_gpg_hand_computed():
    # B = 6, non-zero scores: 1, 3, 2 -> α = 6/3 = 2; group means 0.5, 1.5, and 2 alone (μ 0)
    scores = torch.tensor([1.0, 0.0, 3.0, 0.0, 0.0, 2.0])
    index = torch.tensor([4, 4, 8, 8, 6, 1])
    mask = torch.ones(6, 2)
    adv, _ = gpg_advantages(scores, index, mask)
    per_row = torch.tensor([1.0, -1.0, 3.0, -3.0, 0.0, 4.0])
    assert torch.equal(adv, per_row[:, None].expand(6, 2))
    assert torch.equal(gpg_advantages(scores, index, mask, f_norm=4.0)[0], adv / 4)
    assert torch.equal(gpg_advantages(scores, index, mask, alpha=1.0)[0], adv / 2)
    # every score 0: α = B / max(0, 1), advantages all 0
    assert (gpg_advantages(torch.zeros(6), index, mask)[0] == 0).all()


def test_passk_hand_computed():
    # group 0: 0, 3, 1 -> best is 3, lead 3 − 1 = 2, std 1.5275 (unbiased)
    # group 1: 2, 2, 1 -> tie for the top: all 0.  group 2: 5, -1 -> lead 6, std 4.2426
    scores = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, 1.0, 5.0, -1.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    mask = torch.ones(8, 1)
    raw, _ = grpo_passk_advantages(scores, index, mask, norm_std=False)
    assert torch.equal(raw[:, 0], torch.tensor([0, 2, 0, 0, 0, 0, 6, 0], dtype=torch.float64))
    adv, _ = grpo_passk_advantages(scores, index, mask, eps=0.0)
    std0, std2 = math.sqrt(((-4 / 3) ** 2 + (5 / 3) ** 2 + (-1 / 3) ** 2) / 2), math.sqrt(18)
    expected = torch.tensor([0, 2 / std0, 0, 0, 0, 0, 6 / std2, 0], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-15, atol=0)
    equal = grpo_passk_advantages(
        torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 2), eps=0.0
    )[0]
    assert (equal == 0).all()
