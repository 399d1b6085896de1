"""The sequence-level cispo and sapo (``level="sequence"``), gspo's dual clip, and the kinds
luspo, vespo, dppo_tv, dppo_kl and dro: each against a loop written from its paper's formula
(40-digit and same-dtype), against its peer's own code (TRL, Liger, AReaL, verl, Tinker: their
tensor formulas written out below as their code computes them), and gradients (gradcheck where
the loss's value carries its gradient, the formula's gradient for the stop-gradient forms).
Their exactness under ``cp_group`` is in
tests/distributed/test_cp_policy_kinds_luspo_vespo_dppo.py."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, make_inputs

import rlops
from rlops.losses import AGG_MODES, POLICY_KINDS

mpmath.mp.dps = 40
F64 = torch.float64

# (kind, options) of the cases checked here: clip ranges wide enough that some tokens clip
CASES = {
    "gspo_dual": ("gspo", {"clip_low": 0.005, "clip_high": 0.006, "dual_clip": 1.004}),
    "cispo_seq": ("cispo", {"clip_low": 0.03, "clip_high": 0.04, "level": "sequence"}),
    "sapo_seq": ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05, "level": "sequence"}),
    "luspo": ("luspo", {"clip_low": 0.02, "clip_high": 0.03}),
    "vespo": ("vespo", {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}),
    "dppo_tv": ("dppo_tv", {"clip_low": 0.05, "clip_high": 0.04, "clip_ratio_c": 1.3}),
    "dppo_kl": ("dppo_kl", {"clip_low": 0.01, "clip_high": 0.008, "clip_ratio_c": 1.3}),
    "dro": ("dro", {"dro_beta": 0.7}),
}
NEW_KINDS = ("luspo", "vespo", "dppo_tv", "dppo_kl", "dro")


# --------------------------------------------------------------------------- the definitions
class Exact:
    """40-digit arithmetic."""

    conv = staticmethod(lambda x: mpmath.mpf(float(x)))
    exp = staticmethod(mpmath.exp)
    log = staticmethod(mpmath.log)
    zero = mpmath.mpf(0)


class Same:
    """Arithmetic in a torch dtype, one scalar at a time (a plain same-dtype loop)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.zero = torch.zeros((), dtype=dtype)

    def conv(self, x):
        return torch.as_tensor(x).to(self.dtype)

    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def definition(case, logp, old, adv, mask, num):
    """``[B][T]`` per-token losses of ``case`` from the papers, one row and token at a time."""
    kind, o = CASES[case]
    c = num.conv
    b, t = logp.shape
    out = [[num.zero for _ in range(t)] for _ in range(b)]
    for i in range(b):
        row = [j for j in range(t) if mask[i, j]]
        lp = {j: c(logp[i, j]) for j in row}
        lq = {j: c(old[i, j]) for j in row}
        d = {j: lp[j] - lq[j] for j in row}
        a = {j: c(adv[i, j]) for j in row}
        if not row:
            continue
        # GSPO's sequence ratio s_i = (π(y_i)/π_old(y_i))^(1/|y_i|)
        s = num.exp(min(sum((d[j] for j in row), num.zero) / len(row), c(20.0)))
        for j in row:
            if kind in ("gspo", "luspo"):
                lo, hi = c(o["clip_low"]), c(o["clip_high"])
                loss = max(-a[j] * s, -a[j] * clip(s, 1 - lo, 1 + hi))
                if kind == "gspo" and a[j] < 0:
                    loss = min(loss, -a[j] * c(o["dual_clip"]))
                if kind == "luspo":  # LUSPO: the sequence's term times its length |y_i|
                    loss = loss * len(row)
            elif kind == "cispo":  # MiniMax-M1's weight, from the sequence ratio
                w = clip(s, 1 - c(o["clip_low"]), 1 + c(o["clip_high"]))
                loss = -w * a[j] * lp[j]
            elif kind == "sapo":  # SAPO's gate f(x) = σ(τ(x − 1))·4/τ of the sequence ratio
                tau = c(o["tau_pos"] if a[j] > 0 else o["tau_neg"])
                loss = -a[j] * 4 / tau / (1 + num.exp(-tau * (s - 1)))
            elif kind == "vespo":  # φ(W) = W^k·e^(λ(1 − W)), W = π(y_i)/π_old(y_i)
                log_w = sum((clip(d[q], c(-20.0), c(20.0)) for q in row), num.zero)
                log_w = clip(log_w, c(math.log(1e-8)), c(20.0))
                w = num.exp(log_w)
                k, lam = (
                    (o["k_pos"], o["lambda_pos"]) if a[j] >= 0 else (o["k_neg"], o["lambda_neg"])
                )
                phi = w ** c(k) * num.exp(c(lam) * (1 - w))
                loss = -phi * a[j] * lp[j]
            elif kind in ("dppo_tv", "dppo_kl"):  # DPPO: a binary trust region on π vs π_old
                p, q = num.exp(lp[j]), num.exp(lq[j])
                if kind == "dppo_tv" and a[j] > 0:
                    keep = p - q <= c(o["clip_high"])
                elif kind == "dppo_tv":
                    keep = p - q >= -c(o["clip_low"])
                else:
                    kl = q * num.log(q / p) + (1 - q) * num.log((1 - q) / (1 - p))
                    keep = (
                        (kl <= c(o["clip_high"])) | (p <= q)
                        if a[j] > 0
                        else (kl <= c(o["clip_low"])) | (p >= q)
                    )
                r = num.exp(min(d[j], c(20.0)))
                loss = -a[j] * min(r, c(o["clip_ratio_c"])) * lp[j] if keep else num.zero
            elif kind == "dro":  # DRO: −(A·log π − β/2·(log π − log π_old)²)
                loss = -(a[j] * lp[j] - c(o["dro_beta"]) / 2 * d[j] ** 2)
            out[i][j] = loss
    return out


def as_tensor(rows, dtype=F64):
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=dtype)


def run(case, logp, old, adv, mask, agg=None, **kw):
    kind, opts = CASES[case]
    return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=agg, **opts, **kw)


def inputs(case, dtype, seed, **kw):
    """:func:`make_inputs`; DPPO's log-probs kept below 0 (probabilities, π < 1)."""
    logp, old, adv, mask = make_inputs(dtype, seed, spread=0.3 if "dppo" in case else 0.05, **kw)
    if "dppo" in case:
        logp, old = logp.clamp_max(-0.01), old.clamp_max(-0.01)
    if case == "gspo_dual":  # rows whose sequence ratio passes the dual clip
        logp = logp + 0.02
    return logp, old, adv, mask


def per_row_adv(adv, mask):
    """One advantage per row (its first entry), as GSPO, LUSPO and VESPO use them."""
    return adv[:, :1].expand_as(adv).contiguous()


def test_new_kinds_are_registered():
    assert set(NEW_KINDS) <= set(POLICY_KINDS)


# --------------------------------------------------------------------------- against the papers
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_papers_formula(case, dtype):
    logp, old, adv, mask = inputs(case, dtype, 5)
    if case in ("gspo_dual", "luspo", "vespo", "sapo_seq", "cispo_seq"):
        adv = per_row_adv(adv, mask)
    nan = torch.tensor(torch.nan, dtype=dtype)
    logp = torch.where(mask.bool(), logp, nan)  # mask-0 entries must never leak
    acc = acc_dtype(dtype)
    mat, _ = run(case, logp, old, adv, mask)
    exact = as_tensor(definition(case, logp, old, adv, mask, Exact))
    same = as_tensor(definition(case, logp, old, adv, mask, Same(acc)), acc)
    assert mat.dtype == acc and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, _ = run(case, logp, old, adv, mask, agg=mode)
        torch.testing.assert_close(loss, rlops.aggregate_loss(mat, mask, mode))


def test_the_cases_exercise_their_branches():
    """The data above clips, dual-clips, drops tokens and truncates ratios somewhere."""
    logp, old, adv, mask = inputs("gspo_dual", F64, 5)
    adv = per_row_adv(adv, mask)
    _, m = run("gspo_dual", logp, old, adv, mask, agg="token-mean")
    assert 0 < m["pg_clipfrac"] < 1 and m["pg_clipfrac_lower"] > 0
    logp, old, adv, mask = inputs("cispo_seq", F64, 5)
    adv = per_row_adv(adv, mask)
    _, m = run("cispo_seq", logp, old, adv, mask, agg="token-mean")
    assert 0 < m["pg_clipfrac"] < 1
    for case in ("dppo_tv", "dppo_kl"):
        logp, old, adv, mask = inputs(case, F64, 5)
        _, m = run(case, logp, old, adv, mask, agg="token-mean")
        assert 0 < m["pg_clipfrac"] < 1 and 0 < m["pg_clipfrac_lower"] < 1, case


def test_hand_computed_values():
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


# --------------------------------------------------------------------------- against the peers
def _batch(seed, b=4, t=11, spread=0.05):
    """float64 inputs with every row non-empty (TRL and Liger average over all rows) and one
    advantage per row (their ``advantages`` are ``(B, 1)``)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05
    logp = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask.to(F64)


def _both(peer, ours, logp):
    """Loss and gradient of the peer's formula and of rlops, both from a fresh leaf."""
    out = []
    for f in (peer, ours):
        x = logp.clone().requires_grad_(True)
        loss = f(x)
        (g,) = torch.autograd.grad(loss, x)
        out.append((loss.detach(), g))
    (pl, pg), (ol, og) = out
    torch.testing.assert_close(ol, pl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(og, pg, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", [0, 1])
def test_trl_sequence_level_cispo_and_sapo(seed):
    """TRL ``GRPOTrainer._compute_loss`` with ``importance_sampling_level="sequence"``:
    ``coef_1 = exp(Σ lr·m / Σ m)`` of shape ``(B, 1)``; cispo ``−clamp(coef_1,
    max=epsilon_high).detach()·A·log π`` summed over tokens / the token count; sapo
    ``−σ(τ(coef_1 − 1))·4/τ·A`` averaged per row, then over rows."""
    logp, old, adv, mask = _batch(seed)
    eps_high = 1.02  # TRL's cispo bound is the ratio itself: rlops' 1 + clip_high

    def coef_1(x):
        return torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)

    def trl_cispo(x):
        per_token = -torch.clamp(coef_1(x), max=eps_high).detach() * adv * x
        return (per_token * mask).sum() / mask.sum()

    def trl_sapo(x):
        taus = torch.where(adv > 0, torch.tensor(1.0, dtype=F64), torch.tensor(1.05, dtype=F64))
        per_token = -torch.sigmoid(taus * (coef_1(x) - 1)) * 4 / taus * adv
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    a = adv.expand_as(logp)
    _both(
        trl_cispo,
        lambda x: rlops.policy_loss(
            x,
            old,
            a,
            mask,
            kind="cispo",
            level="sequence",
            clip_low=math.inf,
            clip_high=eps_high - 1,
        )[0],
        logp,
    )
    _both(
        trl_sapo,
        lambda x: rlops.policy_loss(
            x, old, a, mask, kind="sapo", level="sequence", agg="seq-mean-token-mean"
        )[0],
        logp,
    )


def test_areal_sequence_level_sapo_and_gspo_dual_clip():
    """AReaL ``sapo_loss_fn`` / ``ppo_actor_loss_fn`` with ``importance_sampling_level=
    "sequence"``: the ratio ``exp(mean lr)`` broadcast to the row (with its gradient), the row's
    mean advantage, ``c_clip``: ``min(loss, sign(A)·c·A)``; summed over tokens / the count."""
    logp, old, adv, mask = _batch(3, spread=0.1)
    keep = mask.bool()
    a = adv.expand_as(logp)
    eps, c = 0.02, 1.03

    def seq(x):
        lr = torch.where(keep, x - old, 0.0)
        ratio = torch.exp(lr.sum(1) / keep.sum(1).clamp(min=1)).unsqueeze(1).expand_as(x)
        advs = torch.where(keep, a, 0.0).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True)
        return torch.where(keep, ratio, 0.0), advs.expand_as(x)

    def areal_sapo(x):
        ratio, advs = seq(x)
        gate = torch.where(
            advs > 0,
            torch.sigmoid(1.0 * (ratio - 1.0)) * 4.0,
            torch.sigmoid(1.05 * (ratio - 1.0)) * (4.0 / 1.05),
        )
        return torch.where(keep, -gate * advs, 0).sum() / keep.count_nonzero()

    def areal_gspo(x):
        ratio, advs = seq(x)
        loss = torch.max(-advs * ratio, -advs * torch.clamp(ratio, 1.0 - eps, 1.0 + eps))
        loss = torch.min(loss, torch.sign(advs) * c * advs)
        return torch.where(keep, loss, 0).sum() / keep.count_nonzero()

    _both(
        areal_sapo,
        lambda x: rlops.policy_loss(x, old, a, mask, kind="sapo", level="sequence")[0],
        logp,
    )
    _both(
        areal_gspo,
        lambda x: rlops.policy_loss(x, old, a, mask, kind="gspo", clip_low=eps, dual_clip=c)[0],
        logp,
    )
    _, m = rlops.policy_loss(logp, old, a, mask, kind="gspo", clip_low=eps, dual_clip=c)
    assert m["pg_clipfrac_lower"] > 0  # the dual clip binds on some row


def test_trl_and_liger_luspo():
    """TRL: ``coef_1`` sequence-level, ``−min(coef_1·A, clamp(coef_1, 1 − ε, 1 + ε_h)·A)``
    ``(B, 1)``, then ``(per_token_loss · Σ_t m).mean()``; Liger the same, written as
    ``Σ(per_token_loss·Σ_t m) / (B·1)``."""
    logp, old, adv, mask = _batch(4, spread=0.01)
    lo, hi = 2e-3, 2.5e-3

    def trl_luspo(x):
        coef_1 = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        return (per_token * mask.sum(1, keepdim=True)).mean()

    def liger_luspo(x):
        coef_1 = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        weighted = per_token * mask.sum(1, keepdim=True)
        return weighted.sum() / (x.shape[0] * weighted.shape[1])

    a = adv.expand_as(logp)
    for peer in (trl_luspo, liger_luspo):
        _both(
            peer,
            lambda x: rlops.policy_loss(x, old, a, mask, kind="luspo", agg="seq-mean-token-mean")[
                0
            ],
            logp,
        )
        _both(
            peer,
            lambda x: rlops.policy_loss(
                x, old, a, mask, kind="gspo", clip_low=lo, clip_high=hi, agg="seq-mean-token-sum"
            )[0],
            logp,
        )
    _, m = rlops.policy_loss(logp, old, a, mask, kind="luspo")
    assert 0 < m["pg_clipfrac"] < 1


@pytest.mark.parametrize("spread", [0.02, 0.2, 3.0])
def test_trl_and_liger_vespo(spread):
    """TRL ``get_gamma_weights`` / Liger ``get_gamma_weights``: ``Σ clamp(lr, ±20)·m`` per row,
    clamped to ``[log 1e-8, 20]``, ``log φ = λ + k·log w − λ·w`` with ``(k, λ)`` by ``A ≥ 0``
    (λ clamped at 1e-4), ``nan_to_num``; loss ``−φ·A·log π`` summed / the token count."""
    logp, old, adv, mask = _batch(5, spread=spread)
    adv[0] = 0.0  # A = 0 takes the positive parameters

    def trl_vespo(x):
        with torch.no_grad():
            seq = torch.sum(torch.clamp(x - old, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            log_w = torch.clamp(seq, math.log(1e-8), 20.0)
            w = torch.exp(log_w)
            nonneg = adv >= 0
            k = torch.where(nonneg, 2.0, 3.0)
            lam = torch.where(nonneg, 3.0, 2.0).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return (-phi * adv * x * mask).sum() / mask.sum()

    a = adv.expand_as(logp)
    _both(trl_vespo, lambda x: rlops.policy_loss(x, old, a, mask, kind="vespo")[0], logp)
    _, m = rlops.policy_loss(logp, old, a, mask, kind="vespo")
    # 0 < φ ≤ φ(k/λ) = (k/λ)^k·e^(λ − k), its largest value (1.208 and 1.5 here)
    assert 0 < m["vespo_phi_mean"] <= 1.5


def _verl_dppo(x, old, adv, mask, kind, low, high, c):
    """verl's ``compute_policy_loss_dppo_tv`` / ``_kl`` per token (token-mean), as its code."""
    neg_kl = torch.clamp(x - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    truncated = torch.clamp(ratio, max=c).detach()
    prob, old_prob = torch.exp(x), torch.exp(old)
    if kind == "dppo_tv":
        pos = (prob - old_prob) <= high
        neg = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old - x) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        pos = (binary_kl <= high) | (prob <= old_prob)
        neg = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).detach().float()
    losses = -adv * truncated * x * valid
    frac = ((1.0 - valid) * mask).sum() / mask.sum()
    lower = ((ratio > c).float() * valid * mask).sum() / mask.sum()
    return (losses * mask).sum() / mask.sum(), frac.detach(), lower.detach()


@pytest.mark.parametrize("kind", ["dppo_tv", "dppo_kl"])
def test_verl_dppo(kind):
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(6, 13, generator=g, dtype=F64) * 2.5 - 0.01
    logp = old + 0.4 * torch.randn(6, 13, generator=g, dtype=F64)
    adv = torch.randn(6, 13, generator=g, dtype=F64)
    mask = (torch.rand(6, 13, generator=g) > 0.2).to(F64)
    low, high, c = (0.05, 0.04, 1.3) if kind == "dppo_tv" else (0.01, 0.008, 1.3)
    _both(
        lambda x: _verl_dppo(x, old, adv, mask, kind, low, high, c)[0],
        lambda x: rlops.policy_loss(
            x, old, adv, mask, kind=kind, clip_low=low, clip_high=high, clip_ratio_c=c
        )[0],
        logp,
    )
    _, frac, lower = _verl_dppo(logp, old, adv, mask, kind, low, high, c)
    _, m = rlops.policy_loss(
        logp, old, adv, mask, kind=kind, clip_low=low, clip_high=high, clip_ratio_c=c
    )
    assert 0 < frac < 1 and 0 < lower < 1
    torch.testing.assert_close(m["pg_clipfrac"], frac, rtol=1e-15, atol=0)
    torch.testing.assert_close(m["pg_clipfrac_lower"], lower, rtol=1e-15, atol=0)


def test_tinker_dro():
    """Tinker's ``dro``: ``−(log π·A − 0.5·β·(log π − log π_sampler)²).sum()``."""
    logp, old, adv, mask = _batch(8, spread=0.3)
    keep = mask.bool()
    a = adv.expand_as(logp)

    def tinker(x):
        quad = (x[keep] - old[keep]) ** 2
        return -(x[keep] * a[keep] - 0.5 * 0.4 * quad).sum()

    _both(
        tinker,
        lambda x: rlops.policy_loss(x, old, a, mask, kind="dro", dro_beta=0.4, agg="token-sum")[0],
        logp,
    )


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("case", ["gspo_dual", "sapo_seq", "luspo", "dro"])
def test_gradcheck(case, agg):
    """Where the loss's value carries the gradient: GSPO-token's gradient (s_i·∇log π_t per
    token) is the gradient of the sequence objective when a row has one advantage and its
    tokens equal weights (every mode here) — checked by finite differences."""
    logp, old, adv, mask = _batch(9, b=3, t=5, spread=0.05)
    a = adv.expand_as(logp)
    if case == "dro":
        a = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    x = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: run(case, z, old, a, mask, agg=agg)[0], (x,))


@pytest.mark.parametrize("case", ["cispo_seq", "vespo", "dppo_tv", "dppo_kl"])
def test_stop_gradient_forms_have_the_formulas_gradient(case):
    """cispo, vespo and DPPO weight ∇log π by a constant: the gradient of the token-sum is
    ``−w·A`` per token with the weight w of the definition (``ℓ = −w·A·log π``, so
    ``w = −ℓ / (A·log π)``)."""
    logp, old, adv, mask = inputs(case, F64, 12)
    if case in ("cispo_seq", "vespo"):
        adv = per_row_adv(adv, mask)
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(run(case, x, old, adv, mask, agg="token-sum")[0], x)
    exact = as_tensor(definition(case, logp, old, adv, mask, Exact))
    keep = mask.bool()
    w = torch.where(keep, -exact / (adv * logp), 0)
    torch.testing.assert_close(g, torch.where(keep, -w * adv, 0), rtol=1e-12, atol=1e-14)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("case", CASES)
def test_extreme_inputs_are_finite(case, dtype):
    """log-ratios ±50, log π = 0 (a certain token: DPPO-KL's 1 − π = 0), an all-masked row, one
    action, a 32K-token row."""
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
    for mask in (
        torch.ones(4, 4),
        torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]),
    ):
        for mode in AGG_MODES:
            lp = logp.clone().requires_grad_(True)
            loss, metrics = run(case, lp, old, adv, mask, agg=mode)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), (mode, mask)
            assert all(torch.isfinite(v) for v in metrics.values())
            assert (lp.grad[mask == 0] == 0).all()
    t = 32768
    lp = torch.full((1, t), -1.0, dtype=dtype)
    mat, _ = run(case, lp, lp - 0.01, torch.ones(1, t, dtype=dtype), torch.ones(1, t))
    assert torch.isfinite(mat).all()


def test_all_masked_gives_zero_and_meta_needs_no_host_read():
    for case in CASES:
        logp, old, adv, _ = make_inputs(F64, 17, b=3, t=5)
        lp = logp.clone().requires_grad_(True)
        for mode in AGG_MODES:
            loss, _ = run(case, lp, old, adv, torch.zeros(3, 5), agg=mode)
            (g,) = torch.autograd.grad(loss, lp)
            assert loss == 0 and (g == 0).all(), (case, mode)
        m = torch.empty(3, 7, device="meta", dtype=torch.bool)
        x = torch.empty(3, 7, device="meta", requires_grad=True)
        loss, _ = run(
            case,
            x,
            torch.empty(3, 7, device="meta"),
            torch.empty(3, 7, device="meta"),
            m,
            agg="seq-mean-token-mean",
        )
        loss.backward()


def test_bad_options_name_the_option():
    logp, old, adv, mask = make_inputs(F64, 18, b=2, t=3)

    def call(kind, **o):
        return rlops.policy_loss(logp, old, adv, mask, kind=kind, **o)

    for kind in ("cispo", "sapo"):
        with pytest.raises(ValueError, match="level"):
            call(kind, level="row")
    with pytest.raises(TypeError, match="level"):
        call("gspo", level="sequence")
    with pytest.raises(ValueError, match="dual_clip"):
        call("gspo", dual_clip=1.0)
    with pytest.raises(ValueError, match="lambda_neg"):
        call("vespo", lambda_neg=0.0)
    with pytest.raises(ValueError, match="k_pos"):
        call("vespo", k_pos=math.inf)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        call("dppo_tv", clip_ratio_c=0.0)
    with pytest.raises(ValueError, match="clip_high"):
        call("dppo_kl", clip_high=-1.0)
    with pytest.raises(ValueError, match="dro_beta"):
        call("dro", dro_beta=-0.1)
    with pytest.raises(ValueError, match="clip_low"):
        call("luspo", clip_low=1.0)
    with pytest.raises(TypeError, match="tau_pos"):
        call("luspo", tau_pos=1.0)


# --------------------------------------------------------------------------- verl's registry
def test_verl_registry_dppo_and_bypass_mode():
    """verl's ``dppo_tv`` / ``dppo_kl`` adapters against verl's code (above), and
    ``bypass_mode`` against verl's composition: REINFORCE ``−A·log π·w`` with the truncated
    token IS weight ``w = min(π/π_rollout, 2)`` (token-mean), or the vanilla loss."""
    from rlops.compat import verl

    g = torch.Generator().manual_seed(19)
    old = -torch.rand(5, 9, generator=g, dtype=F64) * 2.5 - 0.01
    logp = (old + 0.4 * torch.randn(5, 9, generator=g, dtype=F64)).clamp_max(-0.01)
    adv = torch.randn(5, 9, generator=g, dtype=F64)
    mask = (torch.rand(5, 9, generator=g) > 0.2).to(F64)
    for kind, low, high in (("dppo_tv", 0.05, 0.04), ("dppo_kl", 0.01, 0.008)):
        cfg = {
            "clip_ratio": 0.3,
            "clip_ratio_low": low,
            "clip_ratio_high": high,
            "clip_ratio_c": 1.3,
        }
        fn = verl.get_policy_loss_fn(kind)
        _both(
            lambda x, k=kind, lo=low, hi=high: _verl_dppo(x, old, adv, mask, k, lo, hi, 1.3)[0],
            lambda x, f=fn, c=cfg: f(old, x, adv, mask, "token-mean", c)[0],
            logp,
        )
        _, frac, lower = _verl_dppo(logp, old, adv, mask, kind, low, high, 1.3)
        _, m = fn(old, logp, adv, mask, "token-mean", cfg)
        assert m["actor/pg_clipfrac"] == pytest.approx(float(frac), rel=1e-15)
        assert m["actor/pg_clipfrac_lower"] == pytest.approx(float(lower), rel=1e-15)
    fn = verl.get_policy_loss_fn("bypass_mode")
    cfg = {
        "clip_ratio": 0.2,
        "policy_loss": {
            "rollout_correction": {
                "loss_type": "reinforce",
                "rollout_is": "token",
                "rollout_is_threshold": 2.0,
            }
        },
    }

    def verl_reinforce(x):
        w = torch.clamp(torch.exp(x.detach() - old), max=2.0)
        return (-adv * x * w * mask).sum() / mask.sum()

    _both(verl_reinforce, lambda x: fn(old, x, adv, mask, "token-mean", cfg)[0], logp)
    _, m = fn(old, logp, adv, mask, "token-mean", cfg)
    assert "rollout_corr/rollout_is_mean" in m and "actor/ppo_kl" in m
    cfg["policy_loss"]["rollout_correction"]["loss_type"] = "ppo_clip"
    want, _ = verl.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)
    assert fn(old, logp, adv, mask, "token-mean", cfg)[0] == want
    with pytest.raises(ValueError, match="rollout_correction"):
        fn(old, logp, adv, mask, "token-mean", {"clip_ratio": 0.2})
