"""A corpus for :func:`rlops.testing.check_policy_loss`: correct policy losses, which must pass
every check, and broken ones, each of which must fail the check it names.

Each entry is a :class:`~tests.testing.corpus_logprobs.Case`: the function, the contract's
keywords (``agg``, ``kind``, the clips, the kind's options) it is checked with, and (for a
broken one) the check it targets. The functions follow the contract's call:
``fn(logp [B, T], old_logp [B, T], advantages [B, T], mask [B, T], num_tokens=, num_seqs=)``.

Left out: ``clip_cov`` and ``kl_cov``, which select among the tokens of each call (as verl's:
per micro-batch), so their micro-batch losses do not sum to the full batch's by design.
"""

from __future__ import annotations

import torch
from tests.testing.corpus_logprobs import Case

import rlops

__all__ = ["BROKEN", "CORRECT"]

#: PPO's clips in this corpus: asymmetric (clip-higher), so that swapping them is a bug
PPO = {"clip_low": 0.2, "clip_high": 0.28}


def rlops_loss(agg: str, kind: str = "ppo", **options) -> Case:
    """``rlops.policy_loss`` with ``kind``, ``agg`` and ``options``, taking the global counts."""

    def fn(logp, old_logp, advantages, mask, num_tokens=None, num_seqs=None):
        counts = {"num_tokens": num_tokens, "num_seqs": num_seqs}
        return rlops.policy_loss(
            logp, old_logp, advantages, mask, kind=kind, agg=agg, **counts, **options
        )

    fn.__qualname__ = f"rlops.policy_loss[{kind}, {agg}]"
    return Case(fn, {"agg": agg, "kind": kind, **options})


def _ppo_terms(logp, old_logp, advantages, clip_low=0.2, clip_high=0.28):
    """verl's clipped surrogate per token: ``max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``
    with ``r = exp(logp − old_logp)``, the constants detached."""
    adv = advantages.detach()
    ratio = torch.exp(logp - old_logp.detach())
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))


def _token_mean(loss, mask, num_tokens=None):
    """verl's ``masked_sum / count``: over the action tokens, by the global count if given."""
    n = mask.sum() if num_tokens is None else num_tokens
    return torch.where(mask.bool(), loss, 0.0).sum() / n


# --------------------------------------------------------------------------- correct
def verl_vanilla(logp, old_logp, advantages, mask, num_tokens=None):
    """verl's ``compute_policy_loss_vanilla`` written plainly: the clipped surrogate, the dual
    clip ``min(·, −A·c)`` with ``c = 3`` where ``A < 0``, token-mean over ``num_tokens``."""
    adv = advantages.detach()
    clip1 = _ppo_terms(logp, old_logp, adv)
    clip2 = torch.minimum(-adv * 3.0, clip1)
    return _token_mean(torch.where(adv < 0, clip2, clip1), mask, num_tokens)


def plain_ppo(logp, old_logp, advantages, mask, num_tokens=None):
    """PPO-clip (clip-higher), no dual clip, token-mean over ``num_tokens``."""
    return _token_mean(_ppo_terms(logp, old_logp, advantages), mask, num_tokens)


def plain_seq_mean_token_mean(logp, old_logp, advantages, mask, num_seqs=None):
    """GRPO's aggregation written plainly: each row's token mean, averaged over the rows
    with an action token (``num_seqs`` of the global batch when given)."""
    loss = torch.where(mask.bool(), _ppo_terms(logp, old_logp, advantages), 0.0)
    n_b = mask.sum(-1)
    per_row = loss.sum(-1) / n_b.clamp_min(1)
    s = (n_b > 0).sum() if num_seqs is None else num_seqs
    return per_row.sum() / s


def plain_dr_grpo(logp, old_logp, advantages, mask, num_seqs=None):
    """Dr.GRPO's ``seq-mean-token-sum-norm`` written plainly: each row's token sum over
    ``L = T``, averaged over the rows with an action token."""
    loss = torch.where(mask.bool(), _ppo_terms(logp, old_logp, advantages), 0.0)
    s = (mask.sum(-1) > 0).sum() if num_seqs is None else num_seqs
    return (loss.sum(-1) / mask.shape[-1]).sum() / s


_PLAIN = {"agg": "token-mean", **PPO}
_SEQ = {"agg": "seq-mean-token-mean", **PPO}

CORRECT: dict[str, Case] = {
    **{
        f"rlops ppo dual_clip {agg}": rlops_loss(agg, **PPO, dual_clip=3.0)
        for agg in rlops.losses.AGG_MODES
    },
    "rlops ppo defaults token-mean": rlops_loss("token-mean"),
    "rlops reinforce token-sum": rlops_loss("token-sum", "reinforce"),
    "rlops gpg token-mean": rlops_loss("token-mean", "gpg"),
    "rlops gspo seq-mean-token-mean": rlops_loss("seq-mean-token-mean", "gspo"),
    "rlops gspo dual_clip seq-mean-token-mean": rlops_loss(
        "seq-mean-token-mean", "gspo", dual_clip=3.0
    ),
    "rlops cispo token-mean": rlops_loss("token-mean", "cispo"),
    "rlops cispo sequence seq-mean-token-mean": rlops_loss(
        "seq-mean-token-mean", "cispo", level="sequence"
    ),
    "rlops sapo seq-mean-token-mean": rlops_loss("seq-mean-token-mean", "sapo"),
    "rlops geo_mean seq-mean-token-mean": rlops_loss("seq-mean-token-mean", "geo_mean"),
    "rlops luspo seq-mean-token-mean": rlops_loss("seq-mean-token-mean", "luspo"),
    "rlops vespo seq-mean-token-sum": rlops_loss("seq-mean-token-sum", "vespo"),
    "rlops dppo_tv token-mean": rlops_loss("token-mean", "dppo_tv"),
    "rlops dppo_kl token-mean": rlops_loss("token-mean", "dppo_kl"),
    "rlops dro seq-mean-token-sum-norm": rlops_loss("seq-mean-token-sum-norm", "dro"),
    "verl_vanilla": Case(verl_vanilla, {**_PLAIN, "dual_clip": 3.0}),
    "plain_ppo": Case(plain_ppo, _PLAIN),
    "plain_seq_mean_token_mean": Case(plain_seq_mean_token_mean, _SEQ),
    "plain_dr_grpo": Case(plain_dr_grpo, {**_SEQ, "agg": "seq-mean-token-sum-norm"}),
}


# --------------------------------------------------------------------------- broken
def micro_batch_own_count(logp, old_logp, advantages, mask, num_tokens=None):
    """micro_batch_invariance: takes ``num_tokens=`` and divides by the micro-batch's own
    token count anyway: the micro-batch losses do not sum to the batch's."""
    return _token_mean(_ppo_terms(logp, old_logp, advantages), mask)


def micro_batch_own_rows(logp, old_logp, advantages, mask, num_seqs=None):
    """micro_batch_invariance: seq-mean-token-mean over the micro-batch's own rows, the
    ``num_seqs=`` it is given ignored."""
    return plain_seq_mean_token_mean(logp, old_logp, advantages, mask)


def old_logp_with_gradient(logp, old_logp, advantages, mask, num_tokens=None):
    """constants: the ratio's denominator is not detached (on-policy ``old_logp = logp``
    then gives a zero gradient)."""
    adv = advantages.detach()
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    return _token_mean(loss, mask, num_tokens)


def advantages_not_detached(logp, old_logp, advantages, mask, num_tokens=None):
    """constants: the advantages carry gradient (a critic's output used as is)."""
    ratio = torch.exp(logp - old_logp.detach())
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
    return _token_mean(loss, mask, num_tokens)


def clip_bounds_swapped(logp, old_logp, advantages, mask, num_tokens=None):
    """values: ``clip(r, 1 − ε_high, 1 + ε_low)``: the two clips exchanged."""
    loss = _ppo_terms(logp, old_logp, advantages, clip_low=0.28, clip_high=0.2)
    return _token_mean(loss, mask, num_tokens)


def clip_wrong_side(logp, old_logp, advantages, mask, num_tokens=None):
    """values: ``min`` of the two surrogates instead of ``max`` (the optimistic bound)."""
    adv = advantages.detach()
    ratio = torch.exp(logp - old_logp.detach())
    loss = torch.minimum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    return _token_mean(loss, mask, num_tokens)


def dual_clip_on_positive_advantages(logp, old_logp, advantages, mask, num_tokens=None):
    """values: the dual clip ``min(·, −A·c)`` applied at every token, ``A > 0`` too."""
    adv = advantages.detach()
    loss = torch.minimum(-adv * 3.0, _ppo_terms(logp, old_logp, adv))
    return _token_mean(loss, mask, num_tokens)


def mask_ignored(logp, old_logp, advantages, mask, num_tokens=None):
    """values: the padding's (finite, arbitrary) losses summed in with the action tokens'."""
    loss = _ppo_terms(logp, old_logp, advantages)
    return loss.sum() / (mask.sum() if num_tokens is None else num_tokens)


def sign_flipped(logp, old_logp, advantages, mask, num_tokens=None):
    """values: the objective returned as the loss (gradient ascent on the loss)."""
    return -plain_ppo(logp, old_logp, advantages, mask, num_tokens)


def sum_instead_of_mean(logp, old_logp, advantages, mask, num_tokens=None):
    """values: token-sum declared as token-mean (the loss scale is the batch's token count)."""
    loss = _ppo_terms(logp, old_logp, advantages)
    return torch.where(mask.bool(), loss, 0.0).sum()


def linear_ratio(logp, old_logp, advantages, mask, num_tokens=None):
    """values: the ratio taken as ``1 + (logp − old_logp)`` (first order) instead of
    ``exp(logp − old_logp)``: off wherever the log-ratio is not small."""
    adv = advantages.detach()
    ratio = 1 + (logp - old_logp.detach())
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    return _token_mean(loss, mask, num_tokens)


def empty_rows_counted(logp, old_logp, advantages, mask, num_seqs=None):
    """values: seq-mean-token-mean that counts the row without an action token in ``S``,
    where the definition (verl's, ``empty_rows="skip"``) leaves it out."""
    loss = torch.where(mask.bool(), _ppo_terms(logp, old_logp, advantages), 0.0)
    per_row = loss.sum(-1) / mask.sum(-1).clamp_min(1)
    return per_row.sum() / (mask.shape[0] if num_seqs is None else num_seqs)


class _DriftedPPO(torch.autograd.Function):
    """A fused PPO loss whose hand-written backward forgot the clip mask."""

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, mask, n):
        ratio = torch.exp(logp - old_logp)
        loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
        ctx.save_for_backward(ratio, advantages, mask, n)
        return (loss * mask).sum() / n

    @staticmethod
    def backward(ctx, g):
        ratio, advantages, mask, n = ctx.saved_tensors
        return g * -advantages * ratio * mask / n, None, None, None, None


def drifted_backward(logp, old_logp, advantages, mask, num_tokens=None):
    """gradients: a fused loss whose backward gives every token the unclipped gradient
    ``−A·r`` (the clip's zero gradient missing): the value is right, the update is not."""
    m = mask.to(logp.dtype)
    n = m.sum() if num_tokens is None else torch.tensor(float(num_tokens))
    return _DriftedPPO.apply(logp, old_logp.detach(), advantages.detach(), m, n)


BROKEN: dict[str, Case] = {
    fn.__name__: Case(fn, options, check)
    for fn, options, check in [
        (micro_batch_own_count, _PLAIN, "micro_batch_invariance"),
        (micro_batch_own_rows, _SEQ, "micro_batch_invariance"),
        (old_logp_with_gradient, _PLAIN, "constants"),
        (advantages_not_detached, _PLAIN, "constants"),
        (clip_bounds_swapped, _PLAIN, "values"),
        (clip_wrong_side, _PLAIN, "values"),
        (dual_clip_on_positive_advantages, {**_PLAIN, "dual_clip": 3.0}, "values"),
        (mask_ignored, _PLAIN, "values"),
        (sign_flipped, _PLAIN, "values"),
        (sum_instead_of_mean, _PLAIN, "values"),
        (linear_ratio, _PLAIN, "values"),
        (empty_rows_counted, _SEQ, "values"),
        (drifted_backward, _PLAIN, "gradients"),
    ]
}
