"""Global counts of 0, negative, NaN or on the meta device; and a NaN at one action token,
which gives a NaN loss and gradient whatever the kind does with the token, stays in its row's
action tokens (sequence-level kinds) or is dropped (mask mode of the rollout importance
weights); a NaN at a mask-0 token changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from tests._losses_util import small_batch

import rlops
from rlops import _checks as checks_module
from rlops.losses import (
    AGG_MODES,
    POLICY_KINDS,
    aggregate_loss,
    entropy_loss,
    policy_loss,
    value_loss,
)
from rlops.losses import aggregation as agg_module

F64 = torch.float64
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
NONE = torch.zeros(2, 3, dtype=torch.long)
COUNTED = [m for m in AGG_MODES if m != "token-sum"]


def _name(mode: str) -> str:
    return "num_tokens" if mode == "token-mean" else "num_seqs"


def _calls(x, mask, mode, count):
    """The four public functions that take the global counts, with ``count`` for ``mode``."""
    kw = {_name(mode): count}
    return [
        lambda: aggregate_loss(x, mask, mode, **kw),
        lambda: policy_loss(x, x, torch.ones_like(x), mask, agg=mode, **kw)[0],
        lambda: value_loss(x, x, torch.zeros_like(x), mask, agg=mode, **kw)[0],
        lambda: entropy_loss(x, mask, agg=mode, **kw)[0],
    ]


# --------------------------------------------------------------------------- a count of 0
@pytest.mark.parametrize("mode", COUNTED)
@pytest.mark.parametrize("zero", [0, 0.0, torch.tensor(0), torch.tensor(0.0)])
def test_zero_count_with_action_tokens_raises_naming_it(mode, zero):
    for call in _calls(X, MASK, mode, zero):
        with pytest.raises(ValueError, match=_name(mode)):
            call()


@pytest.mark.parametrize("mode", COUNTED)
@pytest.mark.parametrize("zero", [0, torch.tensor(0.0)])
def test_zero_count_without_action_tokens_is_a_zero_loss_with_zero_gradient(mode, zero):
    # A data-parallel rank with no action token joins with loss 0 and gradient 0.
    for i in range(4):
        x = X.clone().requires_grad_(True)
        loss = _calls(x, NONE, mode, zero)[i]()
        assert loss == 0
        (g,) = torch.autograd.grad(loss, x)
        assert torch.equal(g, torch.zeros_like(X))


# --------------------------------------------------------------------------- bad counts
@pytest.mark.parametrize("mode", COUNTED)
@pytest.mark.parametrize(
    "bad",
    [
        -1,
        -0.5,
        math.nan,
        math.inf,
        torch.tensor(-3),
        torch.tensor(math.nan),
        torch.tensor(-math.inf, dtype=F64),
    ],
)
def test_negative_nan_or_infinite_count_raises_naming_it(mode, bad):
    for call in _calls(X, MASK, mode, bad):
        with pytest.raises(ValueError, match=_name(mode)):
            call()


def test_meta_count_raises_naming_it():
    meta = torch.empty((), device="meta")
    for mode in COUNTED:
        for call in _calls(X, MASK, mode, meta):
            with pytest.raises(ValueError, match=f"{_name(mode)} .*meta device"):
                call()
    # everything on the meta device: shapes only, no value read
    x = torch.empty(2, 3, device="meta")
    out = aggregate_loss(x, torch.empty(2, 3, device="meta"), num_tokens=meta)
    assert out.shape == () and out.device.type == "meta"


def test_counts_that_are_not_read_give_a_non_finite_loss_not_a_rescaled_one(monkeypatch):
    # Where values are not read (a count tensor on an accelerator, without
    # RLOPS_CHECK_VALUES=1) nothing is checked on the host: a count of 0 with action tokens
    # gives x/0 and a negative count NaN; a count of 0 without action tokens still gives 0.
    monkeypatch.setattr(agg_module, "values_checked", lambda t: False)
    monkeypatch.setattr(checks_module, "values_checked", lambda t: False)
    assert aggregate_loss(X, MASK, num_tokens=torch.tensor(0)) == math.inf
    assert aggregate_loss(X, MASK, num_tokens=0) == math.inf
    assert aggregate_loss(X, MASK, "seq-mean-token-mean", num_seqs=torch.tensor(0)) == math.inf
    assert aggregate_loss(X, MASK, num_tokens=torch.tensor(-3.0)).isnan()
    assert aggregate_loss(X, MASK, num_tokens=torch.tensor(math.nan)).isnan()
    x = X.clone().requires_grad_(True)
    loss = aggregate_loss(x, NONE, num_tokens=torch.tensor(0))
    (g,) = torch.autograd.grad(loss, x)
    assert loss == 0 and torch.equal(g, torch.zeros_like(X))
    # a positive count is the plain denominator: (1 + 2 + 4) / 7
    assert aggregate_loss(X, MASK, num_tokens=torch.tensor(7)) == 1.0


# --------------------------------------------------------------------------- NaN in a row
@pytest.mark.parametrize("kind", ["gspo", "geo_mean", "ppo"])
def test_nan_action_token_does_not_fill_mask_0_entries(kind):
    # The row's sequence ratio is NaN; the mask-0 entry stays 0 (as ppo's), the other row is
    # untouched, and no gradient reaches a mask-0 entry.
    logp = torch.tensor([[math.nan, -1.0, -1.0], [-0.5, -0.2, -3.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, _ = policy_loss(
        logp, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64), mask, kind=kind, agg=None
    )
    assert loss[0, 2] == 0 and loss[1, 2] == 0
    assert torch.isfinite(loss[1]).all()
    loss.sum().backward()
    assert (logp.grad[mask == 0] == 0).all() and torch.isfinite(logp.grad[1]).all()


def test_nan_action_token_reproducer_of_gspo():
    loss, _ = policy_loss(
        torch.tensor([[math.nan, -1.0, -1.0]]),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        torch.tensor([[1, 1, 0]]),
        kind="gspo",
        agg=None,
    )
    assert loss[0, 2] == 0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mask_mode_drops_a_nan_log_weight(level):
    # [L, H] = [log 0.5, log 2]: a NaN log-weight is not inside, so it is dropped (keep False,
    # weight 0): the token at token level, its whole row at sequence and geometric level.
    old = torch.tensor([[math.nan, -1.0, -1.0], [-1.0, -1.2, -0.9]], dtype=F64)
    rollout = torch.full((2, 3), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, keep, _ = rlops.rollout_importance_weights(
        old, rollout, mask, level=level, mode="mask", threshold=2.0, low=0.5
    )
    assert not w.isnan().any()
    dropped = [[True, False, False]] if level == "token" else [[True, True, True]]
    assert torch.equal(keep[0], ~torch.tensor(dropped[0]))
    assert (w[0][~keep[0]] == 0).all()
    if level == "token":
        assert torch.equal(w[0, 1:], torch.ones(2, dtype=F64))
    # the other row is kept with its weight: exp(ℓ) of that level
    d = torch.tensor([0.0, -0.2], dtype=F64)
    lw = {"token": d, "sequence": d.sum().expand(2), "geometric": d.mean().expand(2)}[level]
    assert keep[1, :2].all() and not keep[1, 2]
    torch.testing.assert_close(w[1, :2], torch.exp(lw), rtol=1e-15, atol=0)


# --------------------------------------------------------------------------- NaN, every kind
ACTION, MASKED = (0, 1), (1, 4)  # an action token, and a mask-0 token of small_batch()


def _run(kind, logp, old, adv, weights, mask, **kw):
    extra = {"generator": torch.Generator().manual_seed(1)} if kind == "clip_cov" else {}
    if kind == "clip_cov":
        extra["clip_cov_ratio"] = 0.2
    return policy_loss(logp, old, adv, mask, kind=kind, rollout_is_weights=weights, **extra, **kw)


INPUTS = ("logp", "old_logp", "advantages", "rollout_is_weights")


def poisoned(which, at):
    logp, old, adv, weights, mask = small_batch()
    x = dict(zip(INPUTS, (logp, old, adv, weights)))
    x[which] = x[which].clone()
    x[which][at] = math.nan
    logp = x["logp"].clone().requires_grad_(True)
    return logp, x["old_logp"], x["advantages"], x["rollout_is_weights"], mask


@pytest.mark.parametrize("which", INPUTS)
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_at_an_action_token_gives_a_nan_loss_and_gradient(kind, which):
    logp, old, adv, w, mask = poisoned(which, ACTION)
    loss, _ = _run(kind, logp, old, adv, w, mask)
    assert loss.isnan()
    loss.backward()
    assert logp.grad[ACTION].isnan()  # no optimizer step can take a finite gradient from it


@pytest.mark.parametrize("which", INPUTS)
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_at_a_masked_token_changes_nothing(kind, which):
    # a mask-0 token is not part of the loss: loss and gradient are those of the clean batch
    logp0, old0, adv0, w0, mask = small_batch()
    logp0.requires_grad_(True)
    clean, _ = _run(kind, logp0, old0, adv0, w0, mask)
    clean.backward()
    logp, old, adv, w, _ = poisoned(which, MASKED)
    loss, _ = _run(kind, logp, old, adv, w, mask)
    loss.backward()
    assert torch.equal(loss, clean)
    assert torch.equal(logp.grad, logp0.grad)


@pytest.mark.parametrize("which", ("logp", "old_logp", "advantages"))
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_stays_on_its_token_or_its_row_in_the_loss_matrix(kind, which):
    # agg=None: NaN at the poisoned token (a per-row kind: on its row's action tokens), never
    # on a mask-0 entry nor on another row
    logp, old, adv, w, mask = poisoned(which, ACTION)
    mat, _ = _run(kind, logp, old, adv, w, mask, agg=None)
    assert mat[ACTION].isnan()
    assert torch.equal(mat[mask == 0], torch.zeros_like(mat[mask == 0]))
    assert not mat[1:].isnan().any()


@pytest.mark.parametrize("kind", ("dppo_tv", "dppo_kl"))
@pytest.mark.parametrize("which", ("logp", "old_logp"))
def test_regression_dppo_nan_log_prob_is_not_dropped_by_the_trust_region(kind, which):
    # before: the NaN token compared False with the trust region, was dropped, and the loss
    # was finite (0.07985 on the batch)
    logp, old, adv, _, mask = poisoned(which, ACTION)
    loss, m = policy_loss(logp, old, adv, mask, kind=kind)
    assert loss.isnan()
    assert m["ppo_kl"].isnan()


def test_regression_vespo_nan_old_logp_is_not_mapped_to_zero():
    # before: φ of the row was NaN and nan_to_num made it 0: loss 0.3587, ppo_kl NaN
    logp, old, adv, _, mask = poisoned("old_logp", ACTION)
    loss, m = policy_loss(logp, old, adv, mask, kind="vespo")
    assert loss.isnan()
    assert m["vespo_phi_mean"].isnan()


def test_vespo_overflowing_phi_still_counts_zero():
    # φ = W^k·e^(λ(1 − W)) overflows for a large k and a tiny λ: TRL and Liger count it 0, and
    # so does rlops (finite loss); only a NaN is kept
    logp = torch.zeros(1, 2, dtype=torch.float32, requires_grad=True)
    old = torch.full((1, 2), -8.0)  # W = e^16
    loss, m = policy_loss(
        logp, old, torch.ones(1, 2), torch.ones(1, 2), kind="vespo", k_pos=10.0, lambda_pos=1e-6
    )
    assert torch.isfinite(loss)
    assert m["vespo_phi_mean"] == 0


def test_inf_log_prob_is_not_turned_into_nan():
    # a −inf log-prob (a token the policy now gives probability 0) was finite for ppo before the
    # NaN rule, and still is: the rule is about NaN only
    logp, old, adv, _, mask = small_batch()
    logp = logp.clone()
    logp[ACTION] = -math.inf
    loss, _ = policy_loss(logp, old, adv, mask, kind="ppo")
    assert torch.isfinite(loss)
