"""``policy_loss(kind="ipo")`` against prime-rl's own ``ipo_loss_fn`` (copied below), against its
formula written one token at a time (40-digit and same-dtype), by hand, its gradient, its
options' checks, and under ``group=`` / ``cp_group=``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, make_inputs
from tests.losses._per_token import per_token
from tests.losses._references import F64, Exact, Same, as_tensor
from tests.losses._two_ranks import assert_group_and_cp_equal_the_whole_batch
from torch import Tensor

import rlops

IPO = {"ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3}  # prime-rl's IPOLossConfig


# --------------------------------------------------------------------------- prime-rl's code
# PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/loss.py at commit
# 559b44772e471d1538537b8805cc77f3824a5e64 (IPOLossConfig: packages/prime-rl-configs/src/
# prime_rl/configs/trainer.py). Copied verbatim (up to ruff format); adapted only in the data
# structures: the dataclasses hold plain tensors (no jaxtyping), the config is a dataclass with
# its defaults.
@dataclass
class LossInputs:
    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = None


@dataclass
class LossOutputs:
    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass
class IPOLossConfig:
    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over a boolean mask; returns 0 when mask is empty."""
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(
    trainer_logprobs: Tensor, inference_logprobs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def ipo_loss_fn(inputs: LossInputs, loss_config: IPOLossConfig) -> LossOutputs:
    """IPO loss type: a symmetric trust region (mask tokens whose probability
    moved more than ``ipo_threshold`` in absolute terms), policy gradient via
    the importance ratio, and a squared-log-ratio KL regularizer."""
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))

    is_masked = abs_probs_diff > loss_config.ipo_threshold
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


# --------------------------------------------------------------------------- the batches
def ragged_batch(seed, b=7, t=41, spread=0.3):
    """``[B, T]`` float64 inputs and, per row, the sample's length (prime-rl's samples are
    ragged, each a 1-D tensor): row 0 has no action token, rows have interior 0-spans."""
    logp, old, adv, mask = make_inputs(F64, seed, b=b, t=t, spread=spread)
    g = torch.Generator().manual_seed(seed + 100)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = mask.bool() & (torch.arange(t) < lengths[:, None])
    weights = 0.5 + torch.rand(b, t, generator=g, dtype=F64)
    return logp, old, adv, mask, weights, lengths


def prime_rl_loss(logp, old, adv, mask, weights, lengths, config):
    """prime-rl's ``compute_loss`` on the rl component: Σ over samples of ``ipo_loss_fn``'s loss,
    divided by the token count (``rl_scale = max(Σ mask, 1)``); ``is_masked`` per sample."""
    total, shares = logp[0].sum() * 0.0, []
    for i, n in enumerate(lengths.tolist()):
        out = ipo_loss_fn(
            LossInputs(logp[i, :n], old[i, :n], None, adv[i, :n], mask[i, :n], weights[i, :n]),
            config,
        )
        total = total + out.loss
        shares.append(out.metrics["is_masked"] * mask[i, :n].sum())  # back to a count
    scale = max(int(mask.sum()), 1)
    return total / scale, sum(shares) / scale


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "config", [IPOLossConfig(), IPOLossConfig(0.05, 0.7, 0.02)], ids=["defaults", "custom"]
)
def test_prime_rl_ipo_loss_fn(seed, config):
    """Loss, gradient and the dropped share (``is_masked``, rlops' ``pg_clipfrac``) equal
    prime-rl's on ragged rows with an empty one, per-token weights (its ``loss_weights``)."""
    logp, old, adv, mask, weights, lengths = ragged_batch(seed)
    opts = {"ipo_threshold": config.ipo_threshold, "adv_tau": config.adv_tau}
    opts["kl_tau"] = config.kl_tau
    x = logp.clone().requires_grad_(True)
    pl, ps = prime_rl_loss(x, old, adv, mask, weights, lengths, config)
    (pg,) = torch.autograd.grad(pl, x)
    x = logp.clone().requires_grad_(True)
    ol, m = rlops.policy_loss(x, old, adv, mask, kind="ipo", rollout_is_weights=weights, **opts)
    (og,) = torch.autograd.grad(ol, x)
    assert 0 < float(ps) < 1  # some tokens moved beyond the threshold, some not
    torch.testing.assert_close(ol, pl, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(og, pg, rtol=1e-13, atol=1e-15)
    # prime-rl's is_masked is a float32 share per sample (an int64 count / an int64 count)
    assert float(m["pg_clipfrac"]) == pytest.approx(float(ps), rel=2e-7)
    worst = max(float((ol - pl).detach().abs()), float((og - pg).abs().max()))
    print(f"prime-rl ipo_loss_fn, seed {seed}: largest |difference| {worst:.2e}")


def test_prime_rl_per_sample_losses():
    """Each sample's loss (prime-rl's per-sample sum) is rlops' row sum of ``ℓ``, the empty row
    included (0 in both)."""
    logp, old, adv, mask, _weights, lengths = ragged_batch(5)
    mat, _ = rlops.policy_loss(logp, old, adv, mask, kind="ipo", agg=None)
    for i, n in enumerate(lengths.tolist()):
        out = ipo_loss_fn(
            LossInputs(logp[i, :n], old[i, :n], None, adv[i, :n], mask[i, :n]), IPOLossConfig()
        )
        torch.testing.assert_close(mat[i].sum(), out.loss, rtol=1e-13, atol=1e-15)
    assert mat[0].abs().sum() == 0 and not mask[0].any()


# --------------------------------------------------------------------------- the definition
def definition(logp, old, adv, mask, num, ipo_threshold=0.1, adv_tau=1.0, kl_tau=1e-3):
    """``[B][T]``: ``−adv_tau·A·r·[|π − π_old| ≤ ipo_threshold] + kl_tau·(log r)²`` per token,
    π = exp(log π) the probabilities, ``r = exp(min(log r, 20))``; 0 off the mask."""
    c = num.conv

    def term(lp, lq, a):
        d = lp - lq
        moved = abs(num.exp(lp) - num.exp(lq)) > c(ipo_threshold)
        pg = num.zero if moved else -c(adv_tau) * a * num.exp(min(d, c(20.0)))
        return pg + c(kl_tau) * d * d

    return per_token(term, logp, old, adv, mask, num)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 127, 128, 129, 1000])
def test_matches_the_definition(t, dtype):
    logp, old, adv, mask = make_inputs(dtype, t, b=3, t=t)
    mask[1, 0] = 1  # one action token at least
    nan = torch.tensor(math.nan, dtype=dtype)
    logp = torch.where(mask.bool(), logp, nan)  # mask-0 entries are never read
    opts = {"ipo_threshold": 0.08, "adv_tau": 0.9, "kl_tau": 0.05}
    mat, _ = rlops.policy_loss(logp, old, adv, mask, kind="ipo", agg=None, **opts)
    exact = as_tensor(definition(logp, old, adv, mask, Exact, **opts))
    same = as_tensor(definition(logp, old, adv, mask, Same(acc_dtype(dtype)), **opts))
    assert mat.dtype == acc_dtype(dtype) and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)
    loss, _ = rlops.policy_loss(logp, old, adv, mask, kind="ipo", **opts)
    torch.testing.assert_close(loss, rlops.aggregate_loss(mat, mask))


def test_hand_computed():
    """log π = [−1, −2, −0.5], log π_old = [−1.2, −1.9, −1], A = [1, −1, 2], the defaults.
    π − π_old: e^−1 − e^−1.2 = 0.0667 (kept), e^−2 − e^−1.9 = −0.0142 (kept), e^−0.5 − e^−1 =
    0.2387 > 0.1 (dropped): ℓ = [−e^0.2 + 1e-3·0.04, e^−0.1 + 1e-3·0.01, 1e-3·0.25]."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    old = torch.tensor([[-1.2, -1.9, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    mat, m = rlops.policy_loss(logp, old, adv, torch.ones(1, 3), kind="ipo", agg=None)
    want = [-math.exp(0.2) + 4e-5, math.exp(-0.1) + 1e-5, 2.5e-4]
    torch.testing.assert_close(mat, torch.tensor([want], dtype=F64), rtol=1e-14, atol=1e-16)
    assert float(m["pg_clipfrac"]) == pytest.approx(1 / 3, rel=1e-15)


def test_identities():
    """With a threshold no probability can pass (≥ 1) and ``kl_tau = 0``, ipo is −A·r: ppo with
    no clip; ``adv_tau`` scales the policy term only."""
    logp, old, adv, mask = make_inputs(F64, 3, spread=0.5)
    logp, old = logp.clamp_max(0), old.clamp_max(0)

    def mat(kind, **o):
        return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=None, **o)[0]

    free = mat("ppo", clip_low=math.inf, clip_high=math.inf)
    assert torch.equal(mat("ipo", ipo_threshold=1.0, kl_tau=0.0), free)
    lr2 = torch.where(mask.bool(), logp - old, 0).square()
    both = mat("ipo", ipo_threshold=1.0, adv_tau=0.3, kl_tau=0.2)
    torch.testing.assert_close(both, 0.3 * free + 0.2 * lr2, rtol=1e-15, atol=1e-16)
    _, m = rlops.policy_loss(logp, old, adv, mask, kind="ipo", ipo_threshold=0.0)
    moved = (logp.exp() - old.exp()).abs() > 0
    keep = mask.bool()
    assert float(m["pg_clipfrac"]) == float((moved & keep).sum()) / float(keep.sum())


# --------------------------------------------------------------------------- gradients
def test_the_formulas_gradient():
    """∂ℓ/∂log π = −adv_tau·A·r·[kept] + 2·kl_tau·log r, 0 off the mask."""
    logp, old, adv, mask = make_inputs(F64, 4, b=5, t=33, spread=0.4)
    opts = {"ipo_threshold": 0.1, "adv_tau": 0.8, "kl_tau": 0.01}
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(
        rlops.policy_loss(x, old, adv, mask, kind="ipo", agg="token-sum", **opts)[0], x
    )
    keep = mask.bool()
    kept = (logp.exp() - old.exp()).abs() <= 0.1
    d = logp - old
    want = torch.where(kept, -0.8 * adv * d.exp(), 0) + 0.02 * d
    torch.testing.assert_close(g, torch.where(keep, want, 0), rtol=1e-14, atol=1e-16)
    assert 0 < int((~kept & keep).sum()) < int(keep.sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradcheck(agg):
    logp, old, adv, _ = make_inputs(F64, 9, b=3, t=5, spread=0.3)
    m = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]])
    opts = {"ipo_threshold": 0.1, "kl_tau": 0.3}

    def f(x):
        return rlops.policy_loss(x, old, adv, m, kind="ipo", agg=agg, **opts)[0]

    _, metrics = rlops.policy_loss(logp, old, adv, m, kind="ipo", **opts)
    assert 0 < metrics["pg_clipfrac"] < 1  # both sides of the trust region
    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


# --------------------------------------------------------------------------- groups
def _ipo(logp, old, adv, mask, **kw):
    return rlops.policy_loss(logp, old, adv, mask, kind="ipo", **kw)


def test_group_and_cp_group_equal_the_whole_batch():
    """Two Gloo ranks, ``group=`` and ``cp_group=`` (contiguous layout): the whole batch's."""
    data = make_inputs(F64, 6, b=6, t=19, spread=0.3)
    assert_group_and_cp_equal_the_whole_batch(_ipo, data, ("pg_clipfrac", "ppo_kl"), "contiguous")
