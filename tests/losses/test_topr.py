"""``policy_loss(kind="topr")`` against ROLL's own TOPR losses (copied below): the current
``_compute_topr_loss`` and the older one that read ``use_topr_neg_loss_coef`` (positive and
negative rows normalised separately: two rlops calls); against its formula one token at a time
(40-digit and same-dtype), by hand, its gradient, its options' checks, ``group=`` /
``cp_group=``."""

from __future__ import annotations

import math

import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, make_inputs
from tests.losses._per_token import per_token
from tests.losses._references import F64, Exact, Same, as_tensor
from tests.losses._two_ranks import assert_group_and_cp_equal_the_whole_batch

import rlops


# --------------------------------------------------------------------------- ROLL's code
# alibaba/ROLL, roll/pipeline/rlvr/actor_pg_worker.py, ActorPGWorker._compute_topr_loss at
# commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a. Copied verbatim (up to ruff format); adapted
# only in the data structures: a function (no ``self``) whose config values are arguments,
# ``data.batch['scores']`` the ``scores`` argument, ``self._cached_metrics.update({...})`` a
# returned dict ``cached``; the one-time logging (a log line) left out.
def _compute_topr_loss(
    ratio, log_probs, old_log_probs, advantages, scores, positive_weight, negative_weight
):
    positive_mask = (scores > 0).float()
    negative_mask = (scores <= 0).float()

    # 计算损失组件
    positive_token_mask = positive_mask.unsqueeze(-1)
    negative_token_mask = negative_mask.unsqueeze(-1)

    positive_loss = -advantages * log_probs * positive_token_mask

    # 负样本: TIS更新，使用clipped importance sampling ratio
    # 梯度是: -[π(τ)/μ(τ)]_0^1 * R(τ) * ∇log π(τ)
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = -clipped_ratio * advantages * log_probs * negative_token_mask

    weighted_positive_loss = positive_weight * positive_loss
    weighted_negative_loss = negative_weight * negative_loss

    topr_loss = weighted_positive_loss + weighted_negative_loss

    # 缓存TOPR相关指标
    negative_lower_clipped = ((ratio < 0.0) & (negative_token_mask > 0)).float()
    negative_upper_clipped = ((ratio > 1.0) & (negative_token_mask > 0)).float()
    negative_total_clipped = negative_lower_clipped + negative_upper_clipped
    cached = {
        "topr_positive_loss": positive_loss,
        "topr_negative_loss": negative_loss,
        "topr_weighted_positive_loss": weighted_positive_loss,
        "topr_weighted_negative_loss": weighted_negative_loss,
        "topr_positive_weight": positive_weight,
        "topr_negative_weight": negative_weight,
        "topr_positive_samples": positive_mask.sum().detach().item(),
        "topr_negative_samples": negative_mask.sum().detach().item(),
        "topr_positive_ratio": (positive_mask.sum() / (positive_mask.size(0) + 1e-8))
        .detach()
        .item(),
        "topr_negative_ratio": (negative_mask.sum() / (negative_mask.size(0) + 1e-8))
        .detach()
        .item(),
        "topr_negative_lower_clipfrac": negative_lower_clipped.mean().detach().item(),
        "topr_negative_upper_clipfrac": negative_upper_clipped.mean().detach().item(),
        "topr_negative_total_clipfrac": negative_total_clipped.mean().detach().item(),
        "topr_scores_mean": scores.mean().detach().item(),
        "topr_scores_std": scores.std().detach().item(),
    }
    return topr_loss, cached


# ROLL roll/utils/functionals.py at the same commit: agg_loss (token-mean and
# seq-mean-token-mean branches) and masked_mean, verbatim (up to ruff format and
# annotations).
def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    batch_num_tokens: int | None = None,
    global_valid_samples: int | None = None,
    weights: torch.Tensor | None = None,
):
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    if global_valid_samples is None:
        global_valid_samples = loss_mat.size(0)
    if loss_agg_mode == "token-mean":
        if weights is None:
            weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
        loss = (loss_mat * weights.unsqueeze(-1)).sum() / batch_num_tokens
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, loss_mask, dim=-1)
        valid_samples = torch.any(loss_mask > 0, dim=-1).float()
        if weights is None:
            weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
        loss = (seq_losses * weights * valid_samples).sum() / (global_valid_samples + 1e-8)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is not None:
        mask_sum = mask.sum(axis=dim)
        return torch.where(
            mask_sum > 0,
            (tensor * mask).sum(axis=dim) / (mask_sum + 1e-8),
            torch.zeros_like(mask_sum),
        )
    else:
        return (tensor * mask).sum() / (mask.sum() + 1e-8)


# The older TOPR loss: alibaba/ROLL roll/pipeline/rlvr/actor_worker.py ActorWorker.loss_func at
# commit 97447137e5bae911ff09792ec5a296ab39ed37f1 (the last to read use_topr_neg_loss_coef), its
# two blocks after the PPO loss, verbatim (up to ruff format); adapted only in the data
# structures (the config's values and data.batch['scores'] are arguments, the PPO term is left
# out: ROLL's TOPR recipe sets rl_loss_coef: 0), with that commit's agg_loss (the two modes) and
# masked_mean.
def old_agg_loss(loss_mat, loss_mask, loss_agg_mode, weights=None, loss_scale=None):
    if loss_agg_mode == "token-mean":
        if weights is None:
            weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
        loss = masked_mean(loss_mat * weights.unsqueeze(-1), loss_mask)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, loss_mask, dim=-1)
        valid_samples = torch.any(loss_mask > 0, dim=-1).float()
        if weights is None:
            weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
        loss = (seq_losses * weights * valid_samples).sum() / (valid_samples.sum() + 1e-8)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss * loss_scale if loss_scale else loss


def old_topr(
    log_probs,
    old_log_probs,
    advantages,
    final_response_mask,
    scores,
    sample_weights,
    postive_loss_coef,
    use_topr_neg_loss_coef,
    loss_agg_mode,
    loss_scale=None,
):
    total_loss = 0.0
    if postive_loss_coef > 0:
        response_positive_mask = (scores > 0).unsqueeze(-1).expand_as(final_response_mask)
        postive_loss = old_agg_loss(
            loss_mat=-log_probs * advantages,
            loss_mask=final_response_mask * response_positive_mask,
            loss_agg_mode=loss_agg_mode,
            weights=torch.ones_like(sample_weights),
            loss_scale=loss_scale,
        )
        total_loss = total_loss + postive_loss * postive_loss_coef
    if use_topr_neg_loss_coef > 0:
        response_negative_mask = (scores <= 0).unsqueeze(-1).expand_as(final_response_mask)
        clipped_ratio = torch.clamp((log_probs.detach() - old_log_probs).exp(), 0, 1)
        topr_neg_loss = old_agg_loss(
            loss_mat=-clipped_ratio * log_probs * advantages,
            loss_mask=final_response_mask * response_negative_mask,
            loss_agg_mode=loss_agg_mode,
            weights=torch.ones_like(sample_weights),
            loss_scale=loss_scale,
        )
        total_loss = total_loss + topr_neg_loss * use_topr_neg_loss_coef
    return total_loss


# --------------------------------------------------------------------------- the batches
def scored_batch(seed, b=8, t=37, agree=True):
    """float64 inputs, a ragged mask with an empty row, one score per row (ROLL's
    ``data.batch['scores']``, binary) and the mask-0 log-probs 0 (ROLL's
    ``op_compute_log_probs`` multiplies them by the response mask). ``agree``: each row's
    advantages carry its score's sign (a group baseline on binary scores: A ≥ 0 where the score
    is 1, A < 0 where it is 0; zeros on a row scored 1); else random signs."""
    logp, old, adv, mask = make_inputs(F64, seed, b=b, t=t, spread=0.4)
    g = torch.Generator().manual_seed(seed + 50)
    scores = (torch.rand(b, generator=g) > 0.5).to(F64)
    scores[:3] = torch.tensor([1.0, 0.0, 1.0])
    if agree:
        adv = torch.where(scores[:, None] > 0, adv.abs(), -adv.abs())
        adv[2, ::3] = 0.0
    return logp * mask, old * mask, adv, mask, scores


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.5, 0.4)], ids=["defaults", "weighted"])
def test_roll_compute_topr_loss(seed, weights):
    """Where the row's score and the advantage's sign agree (binary scores, a group
    baseline): the per-token loss, its token-mean and seq-mean-token-mean, their gradients and
    the clipped share equal ROLL's."""
    w_pos, w_neg = weights
    logp, old, adv, mask, scores = scored_batch(seed)
    keep = mask.bool()
    x = logp.clone().requires_grad_(True)
    lp = x * mask  # ROLL's log-probs: the model's, times the response mask
    roll_mat, cached = _compute_topr_loss(
        (lp - old).exp(), lp, old, adv, scores, positive_weight=w_pos, negative_weight=w_neg
    )
    x2 = logp.clone().requires_grad_(True)
    opts = {"positive_weight": w_pos, "negative_weight": w_neg}
    mat, _ = rlops.policy_loss(x2, old, adv, mask, kind="topr", agg=None, **opts)
    torch.testing.assert_close(mat, torch.where(keep, roll_mat, 0), rtol=1e-15, atol=0)
    for mode, extra in (("token-mean", {}), ("seq-mean-token-mean", {"empty_rows": "count"})):
        theirs = agg_loss(roll_mat, mask, mode, global_valid_samples=mask.shape[0])
        (tg,) = torch.autograd.grad(theirs, x, retain_graph=True)
        y = logp.clone().requires_grad_(True)
        ours, m = rlops.policy_loss(y, old, adv, mask, kind="topr", agg=mode, **opts, **extra)
        (og,) = torch.autograd.grad(ours, y)
        # ROLL's seq-mean divides by (B + 1e-8) and each row by (count + 1e-8): 1e-8 relative
        tol = 1e-14 if mode == "token-mean" else 1e-8
        torch.testing.assert_close(ours, theirs.detach(), rtol=tol, atol=0)
        torch.testing.assert_close(og, tg, rtol=tol, atol=1e-300)
        diff = max(float((ours - theirs).detach().abs()), float((og - tg).abs().max()))
        print(f"ROLL _compute_topr_loss {mode}, seed {seed}: largest |difference| {diff:.2e}")
    # ROLL's share is over all B·T entries; its padding has r = exp(0 − 0) = 1 (not counted)
    want = cached["topr_negative_upper_clipfrac"] * mask.numel() / float(keep.sum())
    assert 0 < want < 1
    assert float(m["pg_clipfrac"]) == pytest.approx(want, rel=1e-6)  # ROLL's float32 mean


def test_roll_row_split_by_its_score_in_general():
    """Where signs and scores disagree (random per-token advantages), ROLL's loss is
    ``kind="reinforce"`` with the weights ``w₊`` on rows scored > 0 and ``w₋·min(r, 1)`` on the
    others (detached inside): the recipe of docs/design/losses.md."""
    logp, old, adv, mask, scores = scored_batch(3, agree=False)
    w_pos, w_neg = 1.2, 0.7
    x = logp.clone().requires_grad_(True)
    lp = x * mask
    roll_mat, _ = _compute_topr_loss((lp - old).exp(), lp, old, adv, scores, w_pos, w_neg)
    theirs = agg_loss(roll_mat, mask, "token-mean")
    (tg,) = torch.autograd.grad(theirs, x)
    y = logp.clone().requires_grad_(True)
    pos = scores[:, None] > 0
    weights = torch.where(pos, w_pos, w_neg * (y - old).exp().clamp_max(1.0))
    ours, _ = rlops.policy_loss(y, old, adv, mask, kind="reinforce", rollout_is_weights=weights)
    (og,) = torch.autograd.grad(ours, y)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(og, tg, rtol=1e-14, atol=0)
    # and kind="topr" differs there: it splits by the sign of A, not by the score
    other, _ = rlops.policy_loss(
        logp, old, adv, mask, kind="topr", positive_weight=w_pos, negative_weight=w_neg
    )
    assert not torch.isclose(other, theirs.detach())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", [0, 4])
def test_roll_older_topr_separately_normalised(seed, mode):
    """ROLL's older TOPR (``postive_loss_coef``, ``use_topr_neg_loss_coef``): each part
    averaged over its own rows. rlops: two calls, each with its rows in ``mask``."""
    logp, old, adv, mask, scores = scored_batch(seed)
    c_pos, c_neg = 0.8, 1.3
    x = logp.clone().requires_grad_(True)
    theirs = old_topr(
        x * mask,
        old,
        adv,
        mask.to(F64),
        scores,
        torch.ones(mask.shape[0], dtype=F64),
        c_pos,
        c_neg,
        mode,
    )
    (tg,) = torch.autograd.grad(theirs, x)
    y = logp.clone().requires_grad_(True)
    pos = mask.bool() & (scores[:, None] > 0)
    neg = mask.bool() & (scores[:, None] <= 0)
    l_pos, _ = rlops.policy_loss(y, old, adv, pos, kind="topr", agg=mode, positive_weight=c_pos)
    l_neg, _ = rlops.policy_loss(y, old, adv, neg, kind="topr", agg=mode, negative_weight=c_neg)
    ours = l_pos + l_neg
    (og,) = torch.autograd.grad(ours, y)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-8, atol=0)  # ROLL's + 1e-8
    torch.testing.assert_close(og, tg, rtol=1e-8, atol=1e-300)
    one, _ = rlops.policy_loss(logp, old, adv, mask, kind="topr", agg=mode)
    assert not torch.isclose(one, theirs.detach())  # one mean over all rows is another loss
    worst = max(float((ours - theirs).detach().abs()), float((og - tg).abs().max()))
    print(f"ROLL older TOPR ({mode}), seed {seed}: largest |difference| {worst:.2e}")


# --------------------------------------------------------------------------- the definition
def definition(logp, old, adv, mask, num, positive_weight=1.0, negative_weight=1.0):
    """``[B][T]``: ``−w₊·A·log π`` where A ≥ 0, ``−w₋·clip(r, 0, 1)·A·log π`` where A < 0."""
    c = num.conv

    def term(lp, lq, a):
        if a >= 0:
            return -c(positive_weight) * a * lp
        r = num.exp(min(lp - lq, c(20.0)))
        return -c(negative_weight) * min(max(r, 0 * r), 0 * r + 1) * a * lp

    return per_token(term, logp, old, adv, mask, num)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 127, 128, 129, 1000])
def test_matches_the_definition(t, dtype):
    logp, old, adv, mask = make_inputs(dtype, t, b=3, t=t, spread=0.4)
    mask[1, 0] = 1
    logp = torch.where(mask.bool(), logp, torch.tensor(math.nan, dtype=dtype))
    opts = {"positive_weight": 0.9, "negative_weight": 1.7}
    mat, _ = rlops.policy_loss(logp, old, adv, mask, kind="topr", agg=None, **opts)
    exact = as_tensor(definition(logp, old, adv, mask, Exact, **opts))
    same = as_tensor(definition(logp, old, adv, mask, Same(acc_dtype(dtype)), **opts))
    assert mat.dtype == acc_dtype(dtype) and mat.shape == logp.shape
    assert_within_ref_error(mat, exact, same)


def test_hand_computed():
    """log π = [−1, −2, −0.5], log r = [0.2, −0.1, 0.5], A = [1, −1, −2], w₊ = 2, w₋ = 0.5:
    ℓ = [−2·1·(−1), −0.5·e^−0.1·(−1)·(−2), −0.5·1·(−2)·(−0.5)] = [2, −e^−0.1, −0.5]; the taper
    binds on the last token only (r = e^0.5 > 1 with A < 0)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    old = logp - torch.tensor([[0.2, -0.1, 0.5]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -2.0]], dtype=F64)
    mat, m = rlops.policy_loss(
        logp,
        old,
        adv,
        torch.ones(1, 3),
        kind="topr",
        agg=None,
        positive_weight=2.0,
        negative_weight=0.5,
    )
    want = torch.tensor([[2.0, -math.exp(-0.1), -0.5]], dtype=F64)
    torch.testing.assert_close(mat, want, rtol=1e-15, atol=0)
    assert float(m["pg_clipfrac"]) == pytest.approx(1 / 3, rel=1e-15)


def test_identities():
    """With every A ≥ 0, topr is reinforce times w₊; w₋ = 0 drops the tokens with A < 0."""
    logp, old, adv, mask = make_inputs(F64, 2, spread=0.4)

    def mat(kind, a=adv, **o):
        return rlops.policy_loss(logp, old, a, mask, kind=kind, agg=None, **o)[0]

    pos = adv.abs()
    torch.testing.assert_close(mat("topr", pos, positive_weight=0.3), 0.3 * mat("reinforce", pos))
    dropped = mat("topr", negative_weight=0.0)
    assert torch.equal(dropped, torch.where(adv >= 0, mat("reinforce"), 0))


# --------------------------------------------------------------------------- gradients
def test_the_formulas_gradient():
    """∂ℓ/∂log π = −w·A with the constant weight w of the definition (``w = −ℓ/(A·log π)``)."""
    logp, old, adv, mask = make_inputs(F64, 12, b=5, t=33, spread=0.5)
    opts = {"positive_weight": 1.3, "negative_weight": 0.6}
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(
        rlops.policy_loss(x, old, adv, mask, kind="topr", agg="token-sum", **opts)[0], x
    )
    keep = mask.bool()
    r = (logp - old).exp()
    w = torch.where(adv >= 0, 1.3, 0.6 * r.clamp_max(1.0))
    torch.testing.assert_close(g, torch.where(keep, -w * adv, 0), rtol=1e-15, atol=0)
    exact = as_tensor(definition(logp, old, adv, mask, Exact, **opts))
    torch.testing.assert_close(
        torch.where(keep, -exact / (adv * logp), 0), torch.where(keep, w, 0), rtol=1e-14, atol=0
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradcheck(agg):
    """Where the weight is constant in log π (A ≥ 0, or A < 0 with r > 1) the loss's value
    carries the gradient: checked by finite differences."""
    logp, old, adv, _ = make_inputs(F64, 9, b=3, t=5, spread=0.3)
    old = torch.where(adv < 0, logp - 0.2, old)  # r = e^0.2 > 1 where A < 0
    m = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]])
    opts = {"positive_weight": 0.7, "negative_weight": 1.9}

    def f(x):
        return rlops.policy_loss(x, old, adv, m, kind="topr", agg=agg, **opts)[0]

    assert (adv[m.bool()] < 0).any() and (adv[m.bool()] > 0).any()
    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


# --------------------------------------------------------------------------- groups
def _topr(logp, old, adv, mask, **kw):
    return rlops.policy_loss(logp, old, adv, mask, kind="topr", negative_weight=0.6, **kw)


def test_group_and_cp_group_equal_the_whole_batch():
    """Two Gloo ranks, ``group=`` and ``cp_group=`` (zigzag layout): the whole batch's."""
    data = make_inputs(F64, 6, b=6, t=19, spread=0.3)
    assert_group_and_cp_equal_the_whole_batch(_topr, data, ("pg_clipfrac", "ppo_kl"))
