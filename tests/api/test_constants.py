"""Inputs that stand for a fixed policy or a target are constants.

``old_logp``, ``rollout_logp``, ``ref_logp``, ``old_values``, ``returns``, advantages, IS weights
and the global counts are detached inside: passing a tensor that requires grad (the same tensor
as the live input, as on a first PPO epoch with ``old_logp=logp``) gives the gradient of the
explicitly detached call, and that gradient is the definition's, not 0.

At ratio 1 (``old_logp = logp``) every policy-loss kind's gradient is the policy gradient: with
per-token weights ``w`` (1 without ``rollout_is_weights``) and ``token-mean`` over ``N`` action
tokens, ``∂loss/∂logp = −A·w·m / N`` (PPO and GSPO at the unclipped ratio 1; CISPO's weight
``sg(clip(1)) = 1``; SAPO's gate has slope ``σ'(0)·4 = 1`` at ``r = 1``; GMPO's ``R_t = 1``;
kl_cov's ``|lr|`` has gradient 0 at ``lr = 0``; REINFORCE is ``−A·log π``).
"""

from __future__ import annotations

import math

import pytest
import torch

import rlops
from rlops.compat import verl
from rlops.losses import KL_KINDS, POLICY_KINDS, aggregate_loss, kl_penalty, policy_loss, value_loss

F64 = torch.float64
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.1, -2.5]], dtype=F64)
ADV = torch.tensor([[1.0, 0.5, -1.0, 2.0], [-0.5, 1.5, 0.25, -2.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]])
N = 6  # action tokens of MASK
# clip_cov with a covariance window no token reaches: it zeroes no token, so it is PPO here
OPTIONS = {"clip_cov": {"clip_cov_lb": 100.0, "clip_cov_ub": 101.0}}
# luspo scales each row by its action count (its constants:
# tests/losses/_references.py)
UNSCALED_KINDS = tuple(k for k in POLICY_KINDS if k != "luspo")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _grad(fn, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(fn(x), x)
    return g


def _same_as_detached(fn, constant=lambda x: x) -> torch.Tensor:
    """The gradient of ``fn(x, constant(x))`` wrt ``x`` equals that of
    ``fn(x, constant(x).detach())`` and is not zero; returned."""
    x = _leaf(LOGP)
    g = _grad(lambda x: fn(x, constant(x)), x)
    g_detached = _grad(lambda x: fn(x, constant(x).detach()), x)
    assert torch.equal(g, g_detached)
    assert (g != 0).any()
    return g


# --------------------------------------------------------------------------- policy_loss
def test_ppo_with_old_logp_equal_to_logp_hand_computed():
    # ratio = 1, unclipped: loss = Σ_m −A / N, so ∂/∂logp = −A·m/N. For the first row
    # A = [1, 0.5, −1 (mask 0), 2] and N = 6: [−1/6, −1/12, 0, −1/3].
    logp = _leaf(LOGP)
    loss, m = policy_loss(logp, logp, ADV, MASK)
    loss.backward()
    want = torch.tensor([[-1 / 6, -1 / 12, 0.0, -1 / 3], [1 / 12, 0.0, -1 / 24, 1 / 3]], dtype=F64)
    torch.testing.assert_close(logp.grad, want, rtol=1e-15, atol=0)
    assert m["ppo_kl"] == 0 and m["pg_clipfrac"] == 0


@pytest.mark.parametrize("kind", UNSCALED_KINDS)
def test_policy_loss_old_logp_is_constant(kind):
    opts = OPTIONS.get(kind, {})
    g = _same_as_detached(lambda x, c: policy_loss(x, c, ADV, MASK, kind=kind, **opts)[0])
    torch.testing.assert_close(g, -ADV * MASK / N, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("kind", UNSCALED_KINDS)
def test_policy_loss_advantages_are_constant(kind):
    # old_logp = logp (ratio 1) and advantages = logp: the gradient is −logp·m/N.
    opts = OPTIONS.get(kind, {})
    g = _same_as_detached(lambda x, c: policy_loss(x, x, c, MASK, kind=kind, **opts)[0])
    torch.testing.assert_close(g, -LOGP * MASK / N, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("kind", UNSCALED_KINDS)
def test_policy_loss_rollout_is_weights_are_constant(kind):
    # weights w = logp multiply the loss; w's own graph is cut: −A·w·m/N.
    opts = OPTIONS.get(kind, {})
    g = _same_as_detached(
        lambda x, c: policy_loss(x, x, ADV, MASK, kind=kind, rollout_is_weights=c, **opts)[0]
    )
    torch.testing.assert_close(g, -ADV * LOGP * MASK / N, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("agg", [None, "seq-mean-token-mean", "token-sum"])
def test_policy_loss_constants_under_other_aggregations(agg):
    def fn(x, c):
        out = policy_loss(x, c, c, MASK, kind="gspo", rollout_is_weights=c, agg=agg)[0]
        return out.sum()

    _same_as_detached(fn)


# --------------------------------------------------------------------------- value_loss
def test_value_loss_returns_are_constant_hand_computed():
    # returns R = 2·V (from V's own graph), no clip, token-mean: ∂/∂V = (V − R)/N = −V/N.
    # Without the detach it would be d/dV ½(V − 2V)² / N = +V/N.
    g = _same_as_detached(lambda x, c: value_loss(x, x, c, MASK)[0], lambda x: 2 * x)
    torch.testing.assert_close(g, -LOGP * MASK / N, rtol=1e-15, atol=0)


def test_value_loss_old_values_are_constant_hand_computed():
    # V = [[0.2, 3]], V_old = V − 1, R = 0, clip 0.2: V_clip = V_old + 0.2 = V − 0.8, a constant.
    # Token 0: (V − R)² = 0.04 < (V_clip − R)² = 0.36, the clipped error (constant) wins: 0.
    # Token 1: 9 > 4.84, the unclipped wins: (V − R)/N = 3/2. With V_old differentiable,
    # token 0 would get (V − 0.8)/N = −0.3.
    v = _leaf(torch.tensor([[0.2, 3.0]], dtype=F64))
    ret = torch.zeros(1, 2, dtype=F64)

    def fn(x, old):
        return value_loss(x, old, ret, torch.ones(1, 2), clip=0.2)[0]

    g = _grad(lambda x: fn(x, x - 1), v)
    assert torch.equal(g, _grad(lambda x: fn(x, (x - 1).detach()), v))
    torch.testing.assert_close(g, torch.tensor([[0.0, 1.5]], dtype=F64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_both_constants(clip):
    def fn(x, c):
        return value_loss(x, c - 0.3, 2 * c, MASK, clip=clip, agg="seq-mean-token-sum")[0]

    _same_as_detached(fn)


# --------------------------------------------------------------------------- kl_penalty
def test_kl_ref_logp_equal_to_logp_hand_computed():
    # k1 = logp − ref: with ref a constant, ∂/∂logp = 1 per token (value 0).
    logp = _leaf(LOGP)
    out = kl_penalty(logp, logp, "k1")
    assert (out == 0).all()
    out.sum().backward()
    assert torch.equal(logp.grad, torch.ones_like(LOGP))


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_ref_logp_is_constant(kind):
    # ref = logp + 0.3 (d = −0.3, where every kind has a non-zero slope)
    _same_as_detached(lambda x, c: kl_penalty(x, c, kind).sum(), lambda x: x + 0.3)


@pytest.mark.parametrize("kind", [k for k in KL_KINDS if not k.endswith("+")])
def test_kl_old_logp_is_constant(kind):
    # old_logp = logp: r = 1 with gradient ∇log π, so ∂(r·k)/∂logp = k + ∂k/∂logp.
    ref = LOGP - torch.tensor([[0.5, -1.0, 0.2, 0.0], [1.5, -0.3, 0.0, -2.0]], dtype=F64)
    g = _same_as_detached(lambda x, c: kl_penalty(x, ref, kind, old_logp=c).sum())
    if kind in ("k1", "kl"):
        torch.testing.assert_close(g, LOGP - ref + 1, rtol=1e-15, atol=1e-15)
    if kind == "k3":  # r·d
        torch.testing.assert_close(g, LOGP - ref, rtol=1e-15, atol=0)


# --------------------------------------------------------------------------- counts
@pytest.mark.parametrize(
    ("mode", "name", "count"),
    [("token-mean", "num_tokens", 12.0), ("seq-mean-token-sum", "num_seqs", 4.0)],
)
def test_global_counts_are_constant(mode, name, count):
    # a count tensor that requires grad gets none; ∂/∂loss_mat = m / count
    x = _leaf(LOGP)
    n = torch.tensor(count, dtype=F64, requires_grad=True)
    for loss in (
        aggregate_loss(x, MASK, mode, **{name: n}),
        policy_loss(x, x, ADV, MASK, agg=mode, **{name: n})[0],
        value_loss(x, x, 2 * x, MASK, agg=mode, **{name: n})[0],
    ):
        assert loss.requires_grad
    (g,) = torch.autograd.grad(aggregate_loss(x, MASK, mode, **{name: n}), x)
    torch.testing.assert_close(g, MASK.to(F64) / count, rtol=1e-15, atol=0)
    assert n.grad is None


# --------------------------------------------------------------------------- rollout correction
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_correction_inputs_are_constant(level, mode):
    # old_logp = logp (the live tensor) and rollout_logp = logp − δ: the weights are constants,
    # so the policy loss built on them has gradient −A·w·m/N.
    delta = torch.tensor([[0.1, -0.2, 0.0, 0.05], [-0.1, 0.0, 0.3, -0.05]], dtype=F64)
    x = _leaf(LOGP)
    w, keep, metrics = rlops.rollout_importance_weights(
        x, x - delta, MASK, level=level, mode=mode, threshold=1.2, low=0.9
    )
    assert not w.requires_grad and not any(v.requires_grad for v in metrics.values())
    assert keep.dtype == torch.bool  # a mask, never a graph
    _, rs = rlops.rollout_rejection_mask(x, x - delta, MASK, {"seq_mean_k3": 0.01})
    assert not any(v.requires_grad for v in rs.values())
    assert not any(
        v.requires_grad for v in rlops.rollout_mismatch_metrics(x, x - delta, MASK).values()
    )
    (g,) = torch.autograd.grad(policy_loss(x, x, ADV, MASK, rollout_is_weights=w)[0], x)
    assert (g != 0).any()
    torch.testing.assert_close(g, -ADV * w * MASK / N, rtol=1e-14, atol=1e-16)


# --------------------------------------------------------------------------- estimators
def test_group_advantages_keep_the_scores_graph_and_the_loss_cuts_it():
    # The estimators are differentiable maps (as gae); their output enters policy_loss as a
    # constant, so a reward model's graph never receives the policy gradient.
    scores = torch.tensor([1.0, 0.0], dtype=F64, requires_grad=True)
    adv, _ = rlops.grpo_advantages(scores, torch.tensor([0, 0]), MASK)
    assert adv.requires_grad
    x = _leaf(LOGP)
    loss, _ = policy_loss(x, x, adv, MASK)
    loss.backward()
    assert scores.grad is None
    torch.testing.assert_close(x.grad, -adv.detach() * MASK / N, rtol=1e-14, atol=1e-16)


# --------------------------------------------------------------------------- adapters
def test_verl_adapters_inherit_the_rule():
    x = _leaf(LOGP)
    loss, *_ = verl.compute_policy_loss(x, x, ADV, MASK, cliprange=0.2, loss_agg_mode="token-mean")
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g, -ADV * MASK / N, rtol=1e-14, atol=1e-16)
    vf, _ = verl.compute_value_loss(x, 2 * x, x, MASK, cliprange_value=math.inf)
    (g,) = torch.autograd.grad(vf, x)
    torch.testing.assert_close(g, -LOGP * MASK / N, rtol=1e-14, atol=1e-16)
    (g,) = torch.autograd.grad(verl.kl_penalty(x, x, "kl").sum(), x)
    assert torch.equal(g, torch.ones_like(LOGP))
