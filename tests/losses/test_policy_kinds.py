"""Every policy-loss kind against a loop written from its paper's formula (40-digit and
same-dtype, ``tests/losses/_references.py``), hand-computed values, metrics and gradients
(gradcheck where the loss's value carries its gradient, the formula's gradient for the
stop-gradient forms). The token kinds with :data:`OPTIONS`; the sequence-level cispo and sapo,
gspo's dual clip, luspo, vespo, dppo_tv, dppo_kl and dro with :data:`CASES` (their exactness
under ``cp_group``: tests/distributed/test_cp_policy_kinds_luspo_vespo_dppo.py)."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, make_inputs
from tests.losses._references import (
    CASES,
    F64,
    KINDS,
    NEW_KINDS,
    OPTIONS,
    Exact,
    Same,
    as_tensor,
    clip,
    clip_cov_candidates,
    definition,
    inputs,
    peer_batch,
    per_row_adv,
    ref_token_losses,
    run_case,
    run_kind,
)
from tests.losses.test_losses import ref_aggregate

import rlops
from rlops.losses import POLICY_KINDS


def test_the_kinds_are_registered():
    assert set(KINDS) <= set(POLICY_KINDS)
    assert set(NEW_KINDS) <= set(POLICY_KINDS)


def chosen_by_clip_cov(logp, old, adv, mask):
    """The tokens clip_cov zeroed (same generator seed as :func:`run`)."""
    mat, _ = run_kind("clip_cov", logp, old, adv, mask, agg=None)
    ppo = as_tensor(
        ref_token_losses(
            "ppo", logp, old, adv, mask, {**OPTIONS["clip_cov"], "dual_clip": math.inf}, Exact
        )
    )
    return {tuple(k) for k in ((mat == 0) & (ppo != 0) & mask.bool()).nonzero().tolist()}


# --------------------------------------------------------------------------- hand-computed values
HAND = {  # 2x3 inputs below; worked in the comments of test_hand_computed_values
    "ppo": [[-1.105170918076, 0.8, -2.0], [2.0, -0.6, 0.0]],
    "reinforce": [[0.9, -1.5, 2.0], [-4.0, 0.85, 0.0]],
    "gpg": [[0.9, -1.5, 2.0], [-4.0, 0.85, 0.0]],
    "gspo": [[-0.8751733190429, 0.9997, -1.750346638086], [2.323668485457, -0.5002, 0.0]],
    "cispo": [[0.9946538262681, -1.2, 2.0], [-4.0, 1.02, 0.0]],
    "sapo": [[-2.105074084571, 1.516795332859, -4.0], [3.809523809524, -1.173166679407, 0.0]],
    "clip_cov": [[-1.105170918076, 0.8, 0.0], [2.0, -0.6, 0.0]],
    "kl_cov": [[-1.005170918076, 0.6065306597126, -2.0], [2.0, -0.674929403788, 0.0]],
    "geo_mean": [
        [-0.904837418036, 0.904837418036, -1.809674836072],
        [2.323668485457, -0.5809171213641, 0.0],
    ],
}
HAND_OPTIONS = {
    "ppo": {},
    "reinforce": {},
    "gpg": {},
    "gspo": {},
    "cispo": {},
    "sapo": {},
    "geo_mean": {},
    "clip_cov": {"clip_cov_lb": 0.5, "clip_cov_ub": 1.0},
    "kl_cov": {"kl_cov_ratio": 0.6},
}


def test_hand_computed_values_of_the_token_kinds():
    """log-ratios lr = [[0.1, −0.5, 0], [0, 0.3, ·]], A = [[1, −1, 2], [−2, 0.5, ·]], defaults.

    ppo (ε 0.2): e^0.1 = 1.10517 inside the clip → −1.10517; e^−0.5 = 0.60653 with A < 0 → the
    clipped 0.8; r = 1 → −2 and 2; e^0.3 = 1.34986 with A > 0 → clipped −0.5·1.2 = −0.6.
    reinforce: −A·log π = [[0.9, −1.5, 2], [−4, 0.85]].
    gspo: s_0 = e^(−0.4/3) = 0.875173, s_1 = e^0.15 = 1.161834, clipped to [1 − 3e-4, 1 + 4e-4]
    pessimistically: −0.875173, +0.9997, −1.750347; 2.323668, −0.5·1.0004.
    cispo (ε 0.2): −clip(r)·A·log π: 1.10517·0.9, −0.8·1.5... = [[0.99465, −1.2, 2], [−4, 1.02]].
    sapo: −A·σ(τ(r − 1))·4/τ, τ = 1 (A > 0) or 1.05: −4σ(0.10517) = −2.10507, ...
    clip_cov (band (0.5, 1)): cov = (A − 0.1)(log π + 1.42) = [[.468, .088, .798], [1.218,
    −.112]]; the PPO-unclipped tokens with cov in the band: only (0, 2), which is zeroed.
    kl_cov (share 0.6: 3 of 5 tokens): the largest covs (1,0), (0,2), (0,0) get +|lr|.
    geo_mean (0.4 in log space): clipped logs [0.1, −0.4, 0] → R_0 = e^−0.1; [0, 0.3] → e^0.15.
    """
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    logp = torch.tensor([[-0.9, -1.5, -1.0], [-2.0, -1.7, -9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0], [-2.0, 0.5, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for kind in KINDS:
        mat, metrics = rlops.policy_loss(
            logp, old, adv, mask, kind=kind, agg=None, **HAND_OPTIONS[kind]
        )
        # pinned to 13 significant digits: 1e-12 relative covers their rounding
        torch.testing.assert_close(
            mat, torch.tensor(HAND[kind], dtype=torch.float64), rtol=1e-12, atol=1e-12, msg=kind
        )
        torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(0.1 / 5, dtype=torch.float64))
    _, m = rlops.policy_loss(
        logp, old, adv, mask, kind="clip_cov", clip_cov_lb=0.5, clip_cov_ub=1.0
    )
    assert m["clip_cov_frac"] == 0.2 and m["pg_clipfrac"] == 0.4
    _, m = rlops.policy_loss(logp, old, adv, mask, kind="kl_cov", kl_cov_ratio=0.6)
    assert m["kl_cov_frac"] == 0.6
    _, m = rlops.policy_loss(logp, old, adv, mask, kind="gspo")
    assert m["pg_clipfrac"] == 0.4  # the clip binds where it is pessimistic: (0, 1) and (1, 1)


def test_hand_computed_values_of_the_cases():
    """One row, log-ratios [0.2, −0.1, 0.5] (mean 0.2/3, sum 0.6), A = 1, log π = [−1, −2, −0.5].

    cispo level="sequence" (clip 0.05): s = e^(0.2/3) = 1.068939 → weight 1.05: −1.05·log π.
    vespo (k 2, λ 3): W = e^0.6 = 1.822119, φ = W²·e^(3(1 − W)) = 3.320117·0.084893 = 0.281857.
    dro (β 0.7): −log π + 0.35·lr² = [1.014, 2.0035, 0.5875].
    dppo_tv (δ 0.2): π − π_old = e^−1 − e^−1.2 = 0.066733 (kept), e^−2 − e^−1.9 = −0.014... (kept,
    moving down), e^−0.5 − e^−1 = 0.238651 > 0.2 (dropped); r = [1.221403, 0.904837]:
    −r·log π = [1.221403, 1.809675, 0].
    """
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    old = logp - torch.tensor([[0.2, -0.1, 0.5]], dtype=F64)
    adv, mask = torch.ones(1, 3, dtype=F64), torch.ones(1, 3)

    def mat(kind, **o):
        return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=None, **o)[0]

    w = math.exp(0.6)
    phi = w**2 * math.exp(3 * (1 - w))
    assert abs(phi - 0.281857) < 1e-6
    want = {
        "cispo": (mat("cispo", clip_low=0.05, level="sequence"), [1.05, 2.1, 0.525]),
        "vespo": (mat("vespo"), [phi, 2 * phi, 0.5 * phi]),
        "dro": (mat("dro", dro_beta=0.7), [1.014, 2.0035, 0.5875]),
        "dppo_tv": (mat("dppo_tv", clip_low=0.2), [math.exp(0.2), 2 * math.exp(-0.1), 0.0]),
    }
    for kind, (got, exp) in want.items():
        torch.testing.assert_close(
            got, torch.tensor([exp], dtype=F64), rtol=1e-12, atol=1e-12, msg=kind
        )


# --------------------------------------------------------------------------- the loop references
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_kind_matches_its_formula(kind, dtype):
    logp, old, adv, mask = make_inputs(dtype, 4, spread=0.5)
    nan = torch.tensor(torch.nan, dtype=dtype)
    logp = torch.where(mask.bool(), logp, nan)  # mask-0 entries must never leak
    chosen = chosen_by_clip_cov(logp, old, adv, mask) if kind == "clip_cov" else None
    if kind == "clip_cov":  # a uniform subset of the candidates, of the quota's size
        cands = clip_cov_candidates(logp, old, adv, mask, OPTIONS["clip_cov"])
        quota = max(int(OPTIONS["clip_cov"]["clip_cov_ratio"] * int(mask.sum())), 1)
        assert chosen <= cands and len(chosen) == min(quota, len(cands)) > 0
    acc = acc_dtype(dtype)
    mat, metrics = run_kind(kind, logp, old, adv, mask, agg=None)
    exact = as_tensor(ref_token_losses(kind, logp, old, adv, mask, OPTIONS[kind], Exact, chosen))
    same = as_tensor(
        ref_token_losses(kind, logp, old, adv, mask, OPTIONS[kind], Same(acc), chosen), acc
    )
    assert mat.dtype == acc and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, _ = run_kind(kind, logp, old, adv, mask, agg=mode)
        ex = ref_aggregate(
            [[mpmath.mpf(float(v)) for v in row] for row in exact.tolist()], mask, mode
        )
        scale = ref_aggregate(exact.abs(), mask, mode)
        assert_within_ref_error(
            loss,
            torch.tensor(float(ex), dtype=torch.float64),
            ref_aggregate(same, mask, mode),
            scale,
        )
    for name, value in metrics.items():
        assert value.shape == () and value.dtype == acc and not value.requires_grad, name
        assert torch.isfinite(value), name


def test_metrics_of_each_kind():
    logp, old, adv, mask = make_inputs(torch.float64, 5, spread=0.5)
    keep = mask.bool()
    n = float(keep.sum())
    d, a = logp - old, adv
    frac = lambda flag: float((flag & keep).sum()) / n  # noqa: E731
    r = torch.exp(d)
    _, m = run_kind("cispo", logp, old, adv, mask)
    assert float(m["pg_clipfrac"]) == frac((r < 0.8) | (r > 1.5))
    _, m = run_kind("geo_mean", logp, old, adv, mask)
    outside = (d < -0.3) | (d > 0.4)
    assert float(m["pg_clipfrac"]) == frac(outside & (a > 0))
    assert float(m["pg_clipfrac_lower"]) == frac(outside & (a < 0))
    _, m = run_kind("kl_cov", logp, old, adv, mask)
    assert float(m["kl_cov_frac"]) == max(int(0.1 * n), 1) / n
    torch.testing.assert_close(m["ppo_kl_abs"], d.abs()[keep].mean())
    _, m = run_kind("gspo", logp, old, adv, mask)
    rows = [i for i in range(mask.shape[0]) if keep[i].any()]
    s = [math.exp(float(d[i][keep[i]].mean())) for i in rows]
    torch.testing.assert_close(
        m["seq_ratio_mean"], torch.tensor(sum(s) / len(s), dtype=torch.float64)
    )
    for kind in ("reinforce", "sapo", "kl_cov"):
        _, m = run_kind(kind, logp, old, adv, mask)
        assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0


# --------------------------------------------------------------------------- the cases' formulas
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_papers_formula(case, dtype):
    logp, old, adv, mask = inputs(case, dtype, 5)
    if case in ("gspo_dual", "luspo", "vespo", "sapo_seq", "cispo_seq"):
        adv = per_row_adv(adv, mask)
    nan = torch.tensor(torch.nan, dtype=dtype)
    logp = torch.where(mask.bool(), logp, nan)  # mask-0 entries must never leak
    acc = acc_dtype(dtype)
    mat, _ = run_case(case, logp, old, adv, mask)
    exact = as_tensor(definition(case, logp, old, adv, mask, Exact))
    same = as_tensor(definition(case, logp, old, adv, mask, Same(acc)), acc)
    assert mat.dtype == acc and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, _ = run_case(case, logp, old, adv, mask, agg=mode)
        torch.testing.assert_close(loss, rlops.aggregate_loss(mat, mask, mode))


def test_the_cases_exercise_their_branches():
    """The data above clips, dual-clips, drops tokens and truncates ratios somewhere."""
    logp, old, adv, mask = inputs("gspo_dual", F64, 5)
    adv = per_row_adv(adv, mask)
    _, m = run_case("gspo_dual", logp, old, adv, mask, agg="token-mean")
    assert 0 < m["pg_clipfrac"] < 1 and m["pg_clipfrac_lower"] > 0
    logp, old, adv, mask = inputs("cispo_seq", F64, 5)
    adv = per_row_adv(adv, mask)
    _, m = run_case("cispo_seq", logp, old, adv, mask, agg="token-mean")
    assert 0 < m["pg_clipfrac"] < 1
    for case in ("dppo_tv", "dppo_kl"):
        logp, old, adv, mask = inputs(case, F64, 5)
        _, m = run_case(case, logp, old, adv, mask, agg="token-mean")
        assert 0 < m["pg_clipfrac"] < 1 and 0 < m["pg_clipfrac_lower"] < 1, case


# --------------------------------------------------------------------------- gradients
def analytic_grad(kind, logp, old, adv, mask, opts, chosen=None):
    """∂(Σ ℓ)/∂log π per token from the formula, stop-gradients honoured."""
    g = torch.zeros(logp.shape, dtype=torch.float64)
    keep = mask.bool()
    for i in range(logp.shape[0]):
        row = [j for j in range(logp.shape[1]) if keep[i, j]]
        for j in row:
            d, a = float(logp[i, j] - old[i, j]), float(adv[i, j])
            r = math.exp(min(d, 20))
            low, high = opts.get("clip_low"), opts.get("clip_high")
            if kind == "gspo":  # ∂/∂log π_t of sg(s_i)·π_t/sg(π_t) is s_i, 0 where clipped
                s = math.exp(sum(float(logp[i, q] - old[i, q]) for q in row) / len(row))
                g[i, j] = 0.0 if -a * clip(s, 1 - low, 1 + high) > -a * s else -a * s
            elif kind == "cispo":
                g[i, j] = -clip(r, 1 - low, 1 + high) * a
            elif kind == "geo_mean":  # ∂/∂lr_t of sg(R_i)·exp(l_t − sg l_t): R_i, 0 if clipped

                def cl(q, i=i, low=low, high=high):
                    dq, aq = float(logp[i, q] - old[i, q]), float(adv[i, q])
                    return min(dq, high) if aq > 0 else max(dq, -low) if aq < 0 else 0.0

                big_r = math.exp(sum(cl(q) for q in row) / len(row))
                passes = (a > 0 and d < high) or (a < 0 and d > -low)
                g[i, j] = -a * big_r if passes else 0.0
    return g


@pytest.mark.parametrize("kind", ["gspo", "cispo", "geo_mean"])
def test_stop_gradient_forms_have_the_formulas_gradient(kind):
    logp, old, adv, mask = make_inputs(torch.float64, 7, b=5, t=33, spread=0.5)
    w = 0.5 + torch.rand(
        logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    lp = logp.clone().requires_grad_(True)
    mat, _ = run_kind(kind, lp, old, adv, mask, agg=None, rollout_is_weights=w)
    (g,) = torch.autograd.grad(mat.sum(), lp)
    want = analytic_grad(kind, logp, old, adv, mask, OPTIONS[kind]) * w
    # one product of a few factors per token: a few ulps
    torch.testing.assert_close(g, want, rtol=8 * torch.finfo(torch.float64).eps, atol=0)
    assert (g[mask == 0] == 0).all()


def test_gspo_is_gspo_at_the_sequence_level():
    """With one advantage per row and seq-mean-token-mean, the token form's gradient equals the
    gradient of GSPO's sequence objective mean_i max(−A_i·s_i, −A_i·clip(s_i)), s_i a
    differentiable geometric-mean ratio. Same for GMPO: mean_i −A_i·exp(mean_t clipped lr)."""
    logp, old, adv, mask = make_inputs(torch.float64, 8, b=6, t=17, spread=0.02)
    adv = adv[:, :1].expand_as(adv).contiguous()
    keep = mask.bool()
    rows = keep.any(-1)
    for kind, opts in (
        ("gspo", {"clip_low": 0.01, "clip_high": 0.012}),
        ("geo_mean", {"clip_low": 0.02, "clip_high": 0.03}),
    ):
        lp = logp.clone().requires_grad_(True)
        loss, _ = rlops.policy_loss(
            lp, old, adv, mask, kind=kind, agg="seq-mean-token-mean", **opts
        )
        (g,) = torch.autograd.grad(loss, lp)
        lp2 = logp.clone().requires_grad_(True)
        lr = torch.where(keep, lp2 - old, 0)
        a = adv[:, 0]
        n = keep.sum(-1).clamp_min(1)
        if kind == "gspo":
            s = torch.exp(lr.sum(-1) / n)
            seq = torch.max(-a * s, -a * s.clamp(1 - opts["clip_low"], 1 + opts["clip_high"]))
        else:
            lr_c = torch.where(
                a[:, None] > 0, lr.clamp_max(opts["clip_high"]), lr.clamp_min(-opts["clip_low"])
            )
            seq = -a * torch.exp(torch.where(keep, lr_c, 0).sum(-1) / n)
        (g_ref,) = torch.autograd.grad(seq[rows].mean(), lp2)
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["ppo", "reinforce", "sapo", "clip_cov", "kl_cov"])
def test_gradcheck(kind):
    logp, old, adv, _ = make_inputs(torch.float64, 9, b=3, t=4, spread=0.5)
    m = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]])

    def f(a):  # old_logp and the advantages are constants: the gradient is logp's only
        return run_kind(kind, a, old, adv, m, agg="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("case", ["gspo_dual", "sapo_seq", "luspo", "dro"])
def test_gradcheck_of_the_cases(case, agg):
    """Where the loss's value carries the gradient: GSPO-token's gradient (s_i·∇log π_t per
    token) is the gradient of the sequence objective when a row has one advantage and its
    tokens equal weights (every mode here) — checked by finite differences."""
    logp, old, adv, mask = peer_batch(9, b=3, t=5, spread=0.05)
    a = adv.expand_as(logp)
    if case == "dro":
        a = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    x = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: run_case(case, z, old, a, mask, agg=agg)[0], (x,))


@pytest.mark.parametrize("case", ["cispo_seq", "vespo", "dppo_tv", "dppo_kl"])
def test_constant_weight_cases_have_the_definitions_gradient(case):
    """cispo, vespo and DPPO weight ∇log π by a constant: the gradient of the token-sum is
    ``−w·A`` per token with the weight w of the definition (``ℓ = −w·A·log π``, so
    ``w = −ℓ / (A·log π)``)."""
    logp, old, adv, mask = inputs(case, F64, 12)
    if case in ("cispo_seq", "vespo"):
        adv = per_row_adv(adv, mask)
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(run_case(case, x, old, adv, mask, agg="token-sum")[0], x)
    exact = as_tensor(definition(case, logp, old, adv, mask, Exact))
    keep = mask.bool()
    w = torch.where(keep, -exact / (adv * logp), 0)
    torch.testing.assert_close(g, torch.where(keep, -w * adv, 0), rtol=1e-12, atol=1e-14)
