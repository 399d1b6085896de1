"""``check_policy_loss``: correct implementations pass; each check fails on a broken
implementation of the bug it names."""

from __future__ import annotations

import math

import pytest
import torch

import rlops
from rlops.compat import slime, verl
from rlops.testing import POLICY_LOSS_CHECKS, check_policy_loss


def rlops_loss(agg):
    def fn(logp, old_logp, advantages, mask, num_tokens=None, num_seqs=None):
        return rlops.policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            clip_low=0.2,
            agg=agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )

    return fn


def float64_loop(logp, old_logp, advantages, mask, num_tokens=None):
    """PPO's clipped loss token by token in float64, token-mean over the global count."""
    total = logp.new_zeros((), dtype=torch.float64)
    n = num_tokens if num_tokens is not None else float(mask.sum())
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                ratio = torch.exp(logp[b, t].double() - old_logp[b, t].detach().double())
                a = float(advantages[b, t].detach())
                total = total + torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    return total / max(n, 1)


def verl_vanilla(logp, old_logp, advantages, mask, num_tokens=None):
    """verl's registered PPO loss (its dual clip at 3), the global count as verl passes it."""
    config = {
        "clip_ratio": 0.2,
        "clip_ratio_c": 3.0,
        "global_batch_info": {"dp_size": 1, "batch_num_tokens": num_tokens},
    }
    return verl.compute_policy_loss_vanilla(
        old_logp, logp, advantages, mask, loss_agg_mode="token-mean", config=config
    )


def slime_token_mean(logp, old_logp, advantages, mask, num_tokens=None):
    """slime's per-token PPO loss, aggregated over the action tokens (the global count).
    slime's caller forms ``ppo_kl = old_logp - logp``: the caller detaches ``old_logp``."""
    pg, _ = slime.compute_policy_loss(old_logp.detach() - logp, advantages, 0.2, 0.2)
    n = mask.sum() if num_tokens is None else num_tokens
    return (pg * mask).sum() / n


# --------------------------------------------------------------------------- broken ones
def empty_rows_counted(logp, old_logp, advantages, mask, num_seqs=None):
    """values: seq-mean-token-mean that counts rows without an action token in the mean."""
    per_token = rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, agg=None)[0]
    per_row = per_token.sum(-1) / mask.sum(-1).clamp_min(1)
    return per_row.sum() / (logp.shape[0] if num_seqs is None else num_seqs)


class _DriftedPPO(torch.autograd.Function):
    """gradients: a fused PPO loss whose hand-written backward forgot the clip mask."""

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, mask, n):
        ratio = torch.exp(logp - old_logp)
        loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
        ctx.save_for_backward(ratio, advantages, mask, n)
        return (loss * mask).sum() / n

    @staticmethod
    def backward(ctx, g):
        ratio, advantages, mask, n = ctx.saved_tensors
        return g * -advantages * ratio * mask / n, None, None, None, None


def drifted_backward(logp, old_logp, advantages, mask, num_tokens=None):
    n = mask.sum() if num_tokens is None else torch.tensor(num_tokens)
    return _DriftedPPO.apply(logp, old_logp.detach(), advantages.detach(), mask.float(), n.float())


def old_logp_with_gradient(logp, old_logp, advantages, mask, num_tokens=None):
    """constants: the ratio's denominator is not detached."""
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    return (loss * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)


def micro_batch_token_mean(logp, old_logp, advantages, mask, num_tokens=None):
    """micro_batch_invariance: takes the global count and divides by the micro-batch's own."""
    return rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2)[0]


BROKEN = {
    "values": (empty_rows_counted, "seq-mean-token-mean"),
    "gradients": (drifted_backward, "token-mean"),
    "constants": (old_logp_with_gradient, "token-mean"),
    "micro_batch_invariance": (micro_batch_token_mean, "token-mean"),
}


def test_every_check_has_a_broken_implementation():
    assert list(BROKEN) == list(POLICY_LOSS_CHECKS)


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_check_catches_its_bug(name):
    fn, agg = BROKEN[name]
    report = check_policy_loss(fn, agg=agg, clip_low=0.2)
    print(report)
    assert name in report.failed, str(report)


@pytest.mark.parametrize("agg", list(rlops.losses.AGG_MODES))
def test_rlops_passes_in_every_mode(agg):
    report = check_policy_loss(rlops_loss(agg), agg=agg, clip_low=0.2)
    print(report)
    report.raise_if_failed()
    assert report["micro_batch_invariance"].ok


@pytest.mark.parametrize("kind", ["gspo", "cispo", "geo_mean"])
def test_rlops_passes_for_other_kinds(kind):
    def fn(logp, old_logp, advantages, mask, num_seqs=None):
        return rlops.policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            kind=kind,
            agg="seq-mean-token-mean",
            num_seqs=num_seqs,
        )

    assert check_policy_loss(fn, agg="seq-mean-token-mean", kind=kind)


@pytest.mark.parametrize(
    "fn, options",
    [
        (float64_loop, {}),
        (verl_vanilla, {"dual_clip": 3.0}),
        (slime_token_mean, {}),
    ],
    ids=["float64_loop", "verl_vanilla", "slime"],
)
def test_correct_implementations_pass(fn, options):
    report = check_policy_loss(fn, agg="token-mean", clip_low=0.2, **options)
    print(report)
    assert report, str(report)


def test_a_function_without_global_counts_skips_micro_batches():
    def fn(logp, old_logp, advantages, mask):
        return rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2)

    report = check_policy_loss(fn, agg="token-mean", clip_low=0.2)
    assert report.ok and report["micro_batch_invariance"].ok is None
    assert "num_tokens" in report["micro_batch_invariance"].figure
    assert math.isfinite(report["values"].value)


def test_a_function_that_counts_every_row_passes_when_told_so():
    """TRL's convention (every row in the sequence means) is a choice, not a bug: with
    ``empty_rows="count"`` the definition and the micro-batches' ``num_seqs`` follow it."""
    report = check_policy_loss(
        empty_rows_counted, agg="seq-mean-token-mean", clip_low=0.2, empty_rows="count"
    )
    assert report, str(report)
    assert report["micro_batch_invariance"].ok is True, str(report)
    with pytest.raises(ValueError, match="empty_rows must be one of"):
        check_policy_loss(empty_rows_counted, agg="token-mean", empty_rows="all")
