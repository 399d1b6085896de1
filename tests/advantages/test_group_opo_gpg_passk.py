"""OPO, GPG and GRPO pass@k against per-group loops written from the formulas (verl's
conventions), hand-computed cases, identities with GRPO, and bad input."""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask

import rlops.group_advantages as ga
from rlops.group_advantages import (
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
)

ESTIMATORS = (opo_advantages, gpg_advantages, grpo_passk_advantages)


def make_batch(dtype, seed, b=23, t=17, singletons=True):
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


def groups_of(index):
    g = defaultdict(list)
    for i, k in enumerate(index.tolist()):
        g[k].append(i)
    return g


def broadcast(a, mask):
    return a[:, None] * mask


# --------------------------------------------------------------------------- references
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


# --------------------------------------------------------------------------- against the loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_matches_loop_reference(dtype, seed):
    scores, index, mask = make_batch(dtype, seed)
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
    scores, index, mask = make_batch(dtype, seed)
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
    scores, index, mask = make_batch(dtype, seed, singletons=False)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_level_scores_are_summed_over_t(dtype):
    scores, index, mask = make_batch(dtype, 3, singletons=False)
    token = torch.zeros(mask.shape, dtype=dtype)
    token[:, -1] = scores
    for fn in ESTIMATORS:
        assert torch.equal(fn(token, index, mask)[0], fn(scores, index, mask)[0]), fn


def test_bool_int_and_float_masks_agree():
    scores, index, mask = make_batch(torch.float32, 4, singletons=False)
    for fn in ESTIMATORS:
        outs = [fn(scores, index, m)[0] for m in (mask, mask.bool(), mask.float(), mask.double())]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), fn


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


# --------------------------------------------------------------------------- identities
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opo_with_equal_lengths_is_dr_grpo(dtype):
    scores, index, _ = make_batch(dtype, 5)
    mask = torch.ones(scores.shape[0], 6)
    mask[:, 4:] = 0  # every row has 4 action tokens
    opo, _ = opo_advantages(scores, index, mask)
    dr, _ = grpo_advantages(scores, index, mask, norm_std=False)
    tol = 4 * torch.finfo(dtype).eps * float(scores.abs().max())
    torch.testing.assert_close(opo, dr, rtol=0, atol=tol)


def test_gpg_without_zero_scores_or_with_alpha_one_is_dr_grpo():
    scores, index, mask = make_batch(torch.float64, 6)
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


# --------------------------------------------------------------------------- groups of one
def test_groups_of_one_follow_verl():
    scores = torch.tensor([2.0, -1.0, 3.0, 5.0])
    index, mask = torch.tensor([1, 2, 2, 3]), torch.ones(4, 1)
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


def test_empty_batch():
    for fn in ESTIMATORS:
        adv, _ = fn(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))
        assert adv.shape == (0, 4)


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 3e38), (torch.float64, 1e300)])
def test_huge_finite_scores_stay_finite(dtype, magnitude):
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


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    s, idx, m = torch.randn(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    for fn in ESTIMATORS:
        with pytest.raises(TypeError, match="scores"):
            fn(torch.ones(4, dtype=torch.long), idx, m)
        with pytest.raises(TypeError, match="index"):
            fn(s, idx.float(), m)
        with pytest.raises(ValueError, match="index"):
            fn(s, idx[:3], m)
        with pytest.raises(ValueError, match="scores"):
            fn(torch.randn(5), idx, m)
        with pytest.raises(ValueError, match="mask"):
            fn(s, idx, torch.full((4, 3), 2.0))
        with pytest.raises(TypeError, match="mask"):
            fn(s, idx, [[1, 1, 1]] * 4)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="f_norm"):
            gpg_advantages(s, idx, m, f_norm=bad)
        with pytest.raises(ValueError, match="alpha"):
            gpg_advantages(s, idx, m, alpha=bad)
    with pytest.raises(TypeError, match="f_norm"):
        gpg_advantages(s, idx, m, f_norm="1")
    with pytest.raises(ValueError, match="eps"):
        grpo_passk_advantages(s, idx, m, eps=-1e-6)
