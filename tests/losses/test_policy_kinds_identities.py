"""Identities between the policy-loss kinds and their limits: a kind reduces to a simpler one
where its options or its data say it must (one token per row, infinite clips, β = 0, ...), its
defaults are its paper's, and clip_cov draws uniformly with its generator."""

from __future__ import annotations

import math

import torch
from tests._losses_util import make_inputs
from tests.losses._references import (
    F64,
    KINDS,
    OPTIONS,
    clip_cov_candidates,
    inputs,
    run_kind,
)

import rlops
from rlops.losses import AGG_MODES


def test_gspo_with_one_token_per_row_is_token_level_ppo():
    logp, old, adv, _ = make_inputs(torch.float64, 12, b=40, t=1, spread=0.3)
    mask = torch.ones(40, 1)
    for low, high in ((0.2, 0.28), (3e-4, 4e-4)):
        outs = []
        for kind in ("gspo", "ppo"):
            lp = logp.clone().requires_grad_(True)
            mat, m = rlops.policy_loss(
                lp, old, adv, mask, kind=kind, clip_low=low, clip_high=high, agg=None
            )
            outs.append((mat, torch.autograd.grad(mat.sum(), lp)[0], m["pg_clipfrac"]))
        for x, y in zip(*outs, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_cispo_with_infinite_clip_is_reinforce_weighted_by_the_ratio():
    """clip_low = clip_high = inf: the CISPO loss −sg(r)·A·log π equals REINFORCE's −A·log π
    with rollout_is_weights = r (value and gradient, up to the order of one product), and its
    gradient is that of the unclipped PPO surrogate −A·r (−A·r·∇log π; the value differs)."""
    logp, old, adv, mask = make_inputs(torch.float64, 13, spread=0.8)
    ratio = torch.exp(logp - old)
    grads = []
    for kind, kw in (
        ("cispo", {"clip_low": math.inf, "clip_high": math.inf}),
        ("reinforce", {"rollout_is_weights": ratio}),
        ("ppo", {"clip_low": math.inf}),
    ):
        lp = logp.clone().requires_grad_(True)
        loss, _ = rlops.policy_loss(lp, old, adv, mask, kind=kind, **kw)
        grads.append((loss, torch.autograd.grad(loss, lp)[0]))
    (cispo, g_c), (rf, g_r), (_, g_p) = grads
    one_product_order = {"rtol": 2 * torch.finfo(torch.float64).eps, "atol": 0}  # w·(A·x)
    torch.testing.assert_close(cispo, rf, **one_product_order)
    torch.testing.assert_close(g_c, g_r, **one_product_order)
    torch.testing.assert_close(g_c, g_p, rtol=2 * torch.finfo(torch.float64).eps, atol=0)


def test_geo_mean_with_one_token_per_row_is_ppo_with_log_space_clips():
    logp, old, adv, _ = make_inputs(torch.float64, 14, b=60, t=1, spread=0.4)
    mask = torch.ones(60, 1)
    geo, _ = rlops.policy_loss(
        logp,
        old,
        adv,
        mask,
        kind="geo_mean",
        agg=None,
        clip_low=-math.log(1 - 0.2),
        clip_high=math.log(1 + 0.28),
    )
    ppo, _ = rlops.policy_loss(logp, old, adv, mask, agg=None, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(geo, ppo, rtol=4 * torch.finfo(torch.float64).eps, atol=0)


def test_degenerate_options_reduce_to_simpler_kinds():
    logp, old, adv, mask = make_inputs(torch.float64, 15, spread=0.5)
    plain, _ = rlops.policy_loss(logp, old, adv, mask, clip_low=math.inf, agg=None)
    kl0, _ = rlops.policy_loss(logp, old, adv, mask, kind="kl_cov", ppo_kl_coef=0.0, agg=None)
    torch.testing.assert_close(kl0, plain, rtol=0, atol=0)
    ppo, _ = rlops.policy_loss(logp, old, adv, mask, agg=None)
    none, _ = rlops.policy_loss(
        logp, old, adv, mask, kind="clip_cov", clip_cov_lb=1e6, clip_cov_ub=1e7, agg=None
    )
    torch.testing.assert_close(none, ppo, rtol=0, atol=0)
    gpg, _ = rlops.policy_loss(logp, old, adv, mask, kind="gpg", agg=None)
    rf, _ = rlops.policy_loss(logp, old, adv, mask, kind="reinforce", agg=None)
    assert torch.equal(gpg, rf)
    for kind in KINDS:  # weights of 1 change nothing; agg=None then aggregate == agg
        a, _ = run_kind(kind, logp, old, adv, mask, agg=None)
        b, _ = run_kind(kind, logp, old, adv, mask, agg=None, rollout_is_weights=torch.ones(6, 29))
        assert torch.equal(a, b), kind
        for mode in AGG_MODES:
            loss, _ = run_kind(kind, logp, old, adv, mask, agg=mode)
            assert torch.equal(loss, rlops.aggregate_loss(a, mask, mode)), (kind, mode)


def test_clip_defaults_and_clip_high_following_clip_low():
    logp, old, adv, mask = make_inputs(torch.float64, 18, spread=0.3)
    for kind, low, high in (
        ("ppo", 0.2, 0.2),
        ("gspo", 3e-4, 4e-4),
        ("cispo", 0.2, 0.2),
        ("geo_mean", 0.4, 0.4),
    ):
        default, _ = rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=None)
        given, _ = rlops.policy_loss(
            logp, old, adv, mask, kind=kind, agg=None, clip_low=low, clip_high=high
        )
        assert torch.equal(default, given), kind
        one, _ = rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=None, clip_low=0.1)
        both, _ = rlops.policy_loss(
            logp, old, adv, mask, kind=kind, agg=None, clip_low=0.1, clip_high=0.1
        )
        assert torch.equal(one, both), kind


def test_sapo_gate_has_ppos_gradient_at_ratio_one():
    adv = torch.tensor([[1.5, -2.0, 0.3]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    loss, _ = rlops.policy_loss(
        logp, logp.detach(), adv, torch.ones(1, 3), kind="sapo", agg="token-sum"
    )
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, -adv, rtol=2 * torch.finfo(torch.float64).eps, atol=0)


def test_clip_cov_draws_with_the_generator_uniformly():
    logp, old, adv, mask = make_inputs(torch.float64, 16, spread=0.3)
    opts = {**OPTIONS["clip_cov"], "clip_cov_ratio": 0.02}
    cands = sorted(clip_cov_candidates(logp, old, adv, mask, opts))
    quota = max(int(0.02 * int(mask.sum())), 1)
    assert len(cands) > quota

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        mat, _ = rlops.policy_loss(
            logp, old, adv, mask, kind="clip_cov", agg=None, generator=gen, **opts
        )
        return {k for k in cands if mat[k] == 0}

    assert draw(3) == draw(3)
    counts = dict.fromkeys(cands, 0)
    trials = 400
    for seed in range(trials):
        picked = draw(seed)
        assert len(picked) == quota
        for k in picked:
            counts[k] += 1
    p = quota / len(cands)  # each candidate's chance; 5 standard deviations either side
    sd = math.sqrt(trials * p * (1 - p))
    assert all(abs(c - trials * p) < 5 * sd for c in counts.values()), (counts, trials * p)


def test_luspo_scales_gspo_by_the_rows_count():
    """Per token, luspo = |y_i|·gspo (value and gradient), packed rows per sequence."""
    logp, old, adv, mask = make_inputs(F64, 13, spread=0.05)
    x = logp.clone().requires_grad_(True)
    ids = (torch.arange(29) >= 13).long().expand(6, 29)
    for kw in ({}, {"seq_ids": ids, "seqs_per_row": 2}):
        lu, _ = rlops.policy_loss(x, old, adv, mask, kind="luspo", clip_low=0.02, agg=None, **kw)
        gs, _ = rlops.policy_loss(x, old, adv, mask, kind="gspo", clip_low=0.02, agg=None, **kw)
        keep = mask.bool()
        if kw:
            n = torch.stack([(keep & (ids == k)).sum(1) for k in (0, 1)], 1).to(F64)
            count = n.gather(1, ids)
        else:
            count = keep.sum(1, keepdim=True).to(F64).expand_as(logp)
        torch.testing.assert_close(lu, gs * count, rtol=1e-14, atol=0)
        (g1,) = torch.autograd.grad(lu.sum(), x)
        (g2,) = torch.autograd.grad((gs * count).sum(), x)
        torch.testing.assert_close(g1, g2, rtol=1e-14, atol=0)


# --------------------------------------------------------------------------- identities, edges
def test_levels_and_limits():
    """level="token" is the default; a row of one token makes the sequence level the token's;
    dro with β = 0 is reinforce; gspo's dual_clip=inf changes nothing; vespo with k = 0 and
    λ → 0 weighs 1 (reinforce); dppo with infinite bounds and clip_ratio_c keeps every token
    (−A·sg(r)·log π)."""
    logp, old, adv, mask = inputs("dppo_tv", F64, 14)

    def mat(kind, lp=logp, m=mask, **o):
        return rlops.policy_loss(
            lp, old[:, : lp.shape[1]], adv[:, : lp.shape[1]], m, kind=kind, agg=None, **o
        )[0]

    for kind in ("cispo", "sapo"):
        assert torch.equal(mat(kind), mat(kind, level="token"))
        one = mask[:, :1]
        assert torch.equal(
            mat(kind, logp[:, :1], one), mat(kind, logp[:, :1], one, level="sequence")
        )
    assert torch.equal(mat("dro", dro_beta=0.0), mat("reinforce"))
    assert torch.equal(mat("gspo", dual_clip=math.inf), mat("gspo"))
    torch.testing.assert_close(
        mat("vespo", k_pos=0.0, k_neg=0.0, lambda_pos=1e-300, lambda_neg=1e-300),
        mat("reinforce"),
        rtol=0,
        atol=0,
    )
    r = torch.where(mask.bool(), torch.exp(logp - old), 0)
    for kind in ("dppo_tv", "dppo_kl"):
        got = mat(kind, clip_low=math.inf, clip_high=math.inf, clip_ratio_c=math.inf)
        torch.testing.assert_close(got, mat("reinforce") * r, rtol=1e-15, atol=0)
