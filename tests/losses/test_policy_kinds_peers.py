"""The sequence-level cispo and sapo, gspo's dual clip, luspo, vespo, dppo_tv, dppo_kl and dro
against their peers' own code (TRL, Liger, AReaL, verl, Tinker: their tensor formulas written
out below as their code computes them), and verl's registry of dppo and bypass mode."""

from __future__ import annotations

import math

import pytest
import torch
from tests.losses._references import (
    F64,
    peer_batch,
)

import rlops


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
    logp, old, adv, mask = peer_batch(seed)
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
    logp, old, adv, mask = peer_batch(3, spread=0.1)
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
    logp, old, adv, mask = peer_batch(4, spread=0.01)
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
    logp, old, adv, mask = peer_batch(5, spread=spread)
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
    logp, old, adv, mask = peer_batch(8, spread=0.3)
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
