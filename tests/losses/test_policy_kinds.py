"""Every policy-loss kind against a loop written from its paper's formula, hand-computed values,
gradients (gradcheck, or the formula's analytic gradient for stop-gradient forms), identities
between kinds, extreme inputs and bad input."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, make_inputs
from tests.losses.test_losses import ref_aggregate

import rlops
from rlops.losses import AGG_MODES, POLICY_KINDS

mpmath.mp.dps = 40

# Options of each kind used by the reference tests (clip_cov's band and kl_cov's share are
# widened so that a 6x29 batch selects several tokens).
OPTIONS = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
    "reinforce": {},
    "gpg": {},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"clip_low": 0.2, "clip_high": 0.5},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "clip_cov": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_cov_ratio": 0.05,
        "clip_cov_lb": 0.1,
        "clip_cov_ub": 2.0,
    },
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.7},
    "geo_mean": {"clip_low": 0.3, "clip_high": 0.4},
}
# the kinds checked here (luspo, vespo, dppo_*, dro and the sequence levels: in
# tests/losses/test_policy_kinds_luspo_vespo_dppo.py)
KINDS = tuple(OPTIONS)
assert set(KINDS) <= set(POLICY_KINDS)


# --------------------------------------------------------------------------- the references
class Exact:
    """40-digit arithmetic."""

    conv = staticmethod(lambda x: mpmath.mpf(float(x)))
    exp = staticmethod(mpmath.exp)
    zero = mpmath.mpf(0)


class Same:
    """Arithmetic in a torch dtype, one scalar at a time."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.zero = torch.zeros((), dtype=dtype)

    def conv(self, x):
        return torch.as_tensor(x).to(self.dtype)

    exp = staticmethod(torch.exp)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def ref_token_losses(kind, logp, old, adv, mask, opts, num, chosen=None):
    """``[B][T]`` per-token losses of ``kind`` from its paper's formula, one token (or row) at a
    time, 0 on mask-0 tokens. ``chosen``: clip_cov's randomly selected tokens (a set)."""
    b, t = logp.shape
    c = num.conv
    acts = [(i, j) for i in range(b) for j in range(t) if mask[i, j]]
    out = [[num.zero for _ in range(t)] for _ in range(b)]
    d = {k: c(logp[k]) - c(old[k]) for k in acts}
    a = {k: c(adv[k]) for k in acts}
    lp = {k: c(logp[k]) for k in acts}
    ratio = {k: num.exp(min(d[k], c(20.0))) for k in acts}
    low, high = opts.get("clip_low"), opts.get("clip_high")

    def ppo(k, r):
        return max(-a[k] * r, -a[k] * clip(r, 1 - c(low), 1 + c(high)))

    if kind in ("clip_cov", "kl_cov"):
        n = len(acts)
        mean_a = sum((a[k] for k in acts), num.zero) / n
        mean_lp = sum((lp[k] for k in acts), num.zero) / n
        cov = {k: (a[k] - mean_a) * (lp[k] - mean_lp) for k in acts}
    for i in range(b):
        row = [k for k in acts if k[0] == i]
        for k in row:
            if kind == "ppo":
                loss = ppo(k, ratio[k])
                if a[k] < 0:
                    loss = min(loss, -a[k] * c(opts["dual_clip"]))
            elif kind in ("reinforce", "gpg"):
                loss = -a[k] * lp[k]
            elif kind == "gspo":  # s_i = (π(y_i)/π_old(y_i))^(1/|y_i|)
                s = num.exp(min(sum((d[q] for q in row), num.zero) / len(row), c(20.0)))
                loss = ppo(k, s)
            elif kind == "cispo":
                loss = -clip(ratio[k], 1 - c(low), 1 + c(high)) * a[k] * lp[k]
            elif kind == "sapo":
                tau = c(opts["tau_pos"] if a[k] > 0 else opts["tau_neg"])
                gate = 1 / (1 + num.exp(-tau * (ratio[k] - 1))) * 4 / tau
                loss = -gate * a[k]
            elif kind == "clip_cov":
                loss = num.zero if k in chosen else ppo(k, ratio[k])
            elif kind == "kl_cov":
                quota = max(int(opts["kl_cov_ratio"] * len(acts)), 1)
                top = sorted(acts, key=lambda q: (-cov[q], q))[:quota]
                loss = -a[k] * ratio[k] + (
                    c(opts["ppo_kl_coef"]) * abs(d[k]) if k in top else num.zero
                )
            elif kind == "geo_mean":  # R_i = (Π_t clipped r_t)^(1/|y_i|)

                def clipped_log(q):
                    if a[q] > 0:
                        return min(d[q], c(high))
                    return max(d[q], -c(low)) if a[q] < 0 else num.zero

                mean = sum((clipped_log(q) for q in row), num.zero) / len(row)
                loss = -a[k] * num.exp(min(mean, c(20.0)))
            out[k[0]][k[1]] = loss
    return out


def as_tensor(rows, dtype=torch.float64):
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=dtype)


def clip_cov_candidates(logp, old, adv, mask, opts):
    """Tokens that clip_cov may zero: not clipped by PPO, covariance strictly inside the band."""
    keep = mask.bool()
    lp, o, a, m = (torch.where(keep, x.double(), 0) for x in (logp, old, adv, mask))
    r = torch.exp((lp - o).clamp_max(20))
    hit = -a * r.clamp(1 - opts["clip_low"], 1 + opts["clip_high"]) > -a * r
    n = keep.sum()
    cov = (a - (a * m).sum() / n) * (lp - (lp * m).sum() / n)
    cand = keep & ~hit & (cov > opts["clip_cov_lb"]) & (cov < opts["clip_cov_ub"])
    return {tuple(k) for k in cand.nonzero().tolist()}


def run(kind, logp, old, adv, mask, agg="token-mean", **kw):
    opts = dict(OPTIONS[kind])
    if kind == "clip_cov":
        opts["generator"] = torch.Generator().manual_seed(11)
    return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=agg, **opts, **kw)


def chosen_by_clip_cov(logp, old, adv, mask):
    """The tokens clip_cov zeroed (same generator seed as :func:`run`)."""
    mat, _ = run("clip_cov", logp, old, adv, mask, agg=None)
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


def test_hand_computed_values():
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
    mat, metrics = run(kind, logp, old, adv, mask, agg=None)
    exact = as_tensor(ref_token_losses(kind, logp, old, adv, mask, OPTIONS[kind], Exact, chosen))
    same = as_tensor(
        ref_token_losses(kind, logp, old, adv, mask, OPTIONS[kind], Same(acc), chosen), acc
    )
    assert mat.dtype == acc and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, _ = run(kind, logp, old, adv, mask, agg=mode)
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
    _, m = run("cispo", logp, old, adv, mask)
    assert float(m["pg_clipfrac"]) == frac((r < 0.8) | (r > 1.5))
    _, m = run("geo_mean", logp, old, adv, mask)
    outside = (d < -0.3) | (d > 0.4)
    assert float(m["pg_clipfrac"]) == frac(outside & (a > 0))
    assert float(m["pg_clipfrac_lower"]) == frac(outside & (a < 0))
    _, m = run("kl_cov", logp, old, adv, mask)
    assert float(m["kl_cov_frac"]) == max(int(0.1 * n), 1) / n
    torch.testing.assert_close(m["ppo_kl_abs"], d.abs()[keep].mean())
    _, m = run("gspo", logp, old, adv, mask)
    rows = [i for i in range(mask.shape[0]) if keep[i].any()]
    s = [math.exp(float(d[i][keep[i]].mean())) for i in rows]
    torch.testing.assert_close(
        m["seq_ratio_mean"], torch.tensor(sum(s) / len(s), dtype=torch.float64)
    )
    for kind in ("reinforce", "sapo", "kl_cov"):
        _, m = run(kind, logp, old, adv, mask)
        assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0


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
    mat, _ = run(kind, lp, old, adv, mask, agg=None, rollout_is_weights=w)
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
        return run(kind, a, old, adv, m, agg="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


# --------------------------------------------------------------------------- identities
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
        a, _ = run(kind, logp, old, adv, mask, agg=None)
        b, _ = run(kind, logp, old, adv, mask, agg=None, rollout_is_weights=torch.ones(6, 29))
        assert torch.equal(a, b), kind
        for mode in AGG_MODES:
            loss, _ = run(kind, logp, old, adv, mask, agg=mode)
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


# --------------------------------------------------------------------------- extreme inputs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_extreme_inputs_are_finite(kind, dtype):
    """log-ratios ±50, an all-masked row, one-action rows, a 32K-token row of log-ratio 0.01."""
    old = torch.tensor(
        [
            [0.0, -50.0, -5.0, 0.0],
            [-50.0, 0.0, -3.0, -3.0],
            [-1, -1, -1, -1],
            [-2.0, -2.0, -2.0, -2.0],
        ],
        dtype=dtype,
    )
    logp = torch.tensor(
        [
            [-50.0, 0.0, -5.0, 0.0],
            [0.0, -50.0, -3.0, -3.0],
            [-1, -1, -1, -1],
            [-1.5, -2.0, -2.0, -2.0],
        ],
        dtype=dtype,
    )
    adv = torch.tensor(
        [[1.0, -1.0, 2.0, 2.0], [-3.0, 3.0, 2.0, 2.0], [1, 1, 1, 1], [-1.0, 0.0, 0.0, 0.0]],
        dtype=dtype,
    )
    masks = [
        torch.ones(4, 4),
        torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]),
    ]
    for mask in masks:
        for mode in AGG_MODES:
            lp = logp.clone().requires_grad_(True)
            loss, metrics = run(kind, lp, old, adv, mask, agg=mode)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), (mode, mask)
            assert all(torch.isfinite(v) for v in metrics.values())
            assert (lp.grad[:, 1:3][mask[:, 1:3] == 0] == 0).all()
    t = 32768
    lp = torch.full((1, t), -1.0, dtype=dtype)
    old = lp - 0.01
    mat, _ = run(kind, lp, old, torch.ones(1, t, dtype=dtype), torch.ones(1, t), agg=None)
    assert torch.isfinite(mat).all()
    if kind in ("gspo", "geo_mean"):  # the row's ratio is e^0.01 (a product would be e^327)
        d = float(lp[0, 0].double() - old[0, 0].double())  # 0.01 as rounded in dtype
        want = -math.exp(d)
        if kind == "gspo":
            want = -min(math.exp(d), 1 + OPTIONS["gspo"]["clip_high"])
        eps = torch.finfo(acc_dtype(dtype)).eps
        assert abs(float(mat[0, 0]) - want) <= 64 * eps, float(mat[0, 0])


def test_all_masked_batch_gives_zero_loss_and_gradient():
    logp, old, adv, _ = make_inputs(torch.float64, 17, b=3, t=5)
    mask = torch.zeros(3, 5)
    for kind in KINDS:
        for mode in AGG_MODES:
            lp = logp.clone().requires_grad_(True)
            loss, metrics = run(kind, lp, old, adv, mask, agg=mode)
            loss.backward()
            assert loss == 0 and (lp.grad == 0).all(), (kind, mode)
            assert all(v == 0 or k == "seq_ratio_mean" for k, v in metrics.items())


@pytest.mark.parametrize("kind", KINDS)
def test_meta_tensors_need_no_host_read(kind):
    """On meta tensors any host read raises: every kind, with weights, forward and backward."""

    def t(*shape, grad=False, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)

    opts = {k: v for k, v in OPTIONS[kind].items() if k != "generator"}
    for dtype in (torch.float32, torch.bfloat16):
        lp = t(3, 7, grad=True, dtype=dtype)
        mask = torch.empty(3, 7, device="meta", dtype=torch.bool)
        loss, metrics = rlops.policy_loss(
            lp, t(3, 7, dtype=dtype), t(3, 7), mask, kind=kind, rollout_is_weights=t(3, 7), **opts
        )
        loss.backward()
        count = torch.empty((), device="meta")
        for mode in AGG_MODES:  # global counts as device tensors are not read either
            rlops.policy_loss(
                lp,
                t(3, 7, dtype=dtype),
                t(3, 7),
                mask,
                kind=kind,
                agg=mode,
                num_tokens=count,
                num_seqs=count,
                **opts,
            )[0].backward()
        cpu, cpu_metrics = rlops.policy_loss(
            torch.zeros(3, 7, dtype=dtype),
            torch.zeros(3, 7),
            torch.zeros(3, 7),
            torch.ones(3, 7),
            kind=kind,
            **opts,
        )
        assert loss.shape == cpu.shape and loss.dtype == cpu.dtype
        assert sorted(metrics) == sorted(cpu_metrics)
        assert lp.grad.shape == lp.shape


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    lp, old, adv, m = make_inputs(torch.float32, 0, b=2, t=3)
    with pytest.raises(ValueError, match="kind"):
        rlops.policy_loss(lp, old, adv, m, kind="grpo")
    with pytest.raises(TypeError, match="dual_clip"):
        rlops.policy_loss(lp, old, adv, m, kind="cispo", dual_clip=3.0)
    with pytest.raises(TypeError, match="clip_low"):
        rlops.policy_loss(lp, old, adv, m, kind="sapo", clip_low=0.2)
    with pytest.raises(TypeError, match="tau"):
        rlops.policy_loss(lp, old, adv, m, tau_pos=1.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        rlops.policy_loss(lp, old, adv, m, kind="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        rlops.policy_loss(lp, old, adv, m, kind="clip_cov", clip_cov_lb=math.nan)
    with pytest.raises(TypeError, match="clip_cov_ub"):
        rlops.policy_loss(lp, old, adv, m, kind="clip_cov", clip_cov_ub=None)
    with pytest.raises(TypeError, match="clip_low"):
        rlops.policy_loss(lp, old, adv, m, kind="gspo", clip_low=None)
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="clip_cov_ratio"):
            rlops.policy_loss(lp, old, adv, m, kind="clip_cov", clip_cov_ratio=bad)
        with pytest.raises(ValueError, match="kl_cov_ratio"):
            rlops.policy_loss(lp, old, adv, m, kind="kl_cov", kl_cov_ratio=bad)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="tau_neg"):
            rlops.policy_loss(lp, old, adv, m, kind="sapo", tau_neg=bad)
    with pytest.raises(ValueError, match="ppo_kl_coef"):
        rlops.policy_loss(lp, old, adv, m, kind="kl_cov", ppo_kl_coef=-1.0)
    for kind in ("gspo", "cispo", "clip_cov"):
        with pytest.raises(ValueError, match="clip_low"):
            rlops.policy_loss(lp, old, adv, m, kind=kind, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        rlops.policy_loss(lp, old, adv, m, kind="geo_mean", clip_high=0.0)
    with pytest.raises(TypeError, match="generator"):
        rlops.policy_loss(lp, old, adv, m, kind="clip_cov", generator=3)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        rlops.policy_loss(lp, old, adv, m, rollout_is_weights=torch.ones(2, 1))
    with pytest.raises(ValueError, match="rollout_is_weights"):
        rlops.policy_loss(lp, old, adv, m, rollout_is_weights=torch.ones(3, 2))
    with pytest.raises(TypeError, match="rollout_is_weights"):
        rlops.policy_loss(lp, old, adv, m, rollout_is_weights=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="num_tokens"):
        rlops.policy_loss(lp, old, adv, m, num_tokens=-1)
    with pytest.raises(ValueError, match="num_seqs"):
        rlops.aggregate_loss(lp, m, num_seqs=torch.ones(2))
    with pytest.raises(TypeError, match="num_tokens"):
        rlops.value_loss(lp, old, adv, m, num_tokens="10")
    with pytest.raises(TypeError, match="group"):
        rlops.aggregate_loss(lp, m, group="world")
