"""slime's CISPO loss, its TIS / IcePop rollout corrections and off-policy sequence masking
(OPSM), on rlops: ``slime/utils/ppo_utils.py`` (``compute_cispo_loss``, ``compute_opsm_mask``)
and ``slime/backends/megatron_utils/loss.py`` (``vanilla_tis_function``, ``icepop_function``).

Tokens are slime's concatenated 1-D layout; each adapter lays them out as one ``[1, N]`` row
(or pads per-sample lists into ``[B, T]``) for one or two rlops calls; OPSM's per-sample
weighted mean is one vectorised torch expression on the padded batch.
"""

from __future__ import annotations

import math

import torch

import rlops
from rlops._checks import as_real, check_nonneg, check_positive, check_same_shape, is_nan
from rlops._numerics import MAX_EXP_ARG
from rlops.compat import _ragged

__all__ = ["compute_cispo_loss", "compute_opsm_mask", "icepop_function", "vanilla_tis_function"]


def _row(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1)


def _ratios(log_ratio: torch.Tensor, upper: float, lower: float | None, mode: str):
    """``(ratio, weight)`` per token of ``log_ratio`` (any shape): the weight of
    :func:`rlops.rollout_importance_weights` at token level (``mode`` truncate:
    ``clip(ratio, lower, upper)``; mask: ``ratio`` inside ``[lower, upper]``, else 0) and the
    ratio ``e^{log_ratio}`` it is made from, saturated as the weight is (at ``MAX_EXP_ARG``),
    so the two are equal wherever no bound applies."""
    lr = _row(log_ratio.detach())
    everywhere = torch.ones_like(lr, dtype=torch.bool)
    weight = rlops.rollout_importance_weights(
        lr, torch.zeros_like(lr), everywhere, mode=mode, threshold=upper, low=lower
    )[0]
    ratio = torch.exp(lr.to(weight.dtype).clamp_max(MAX_EXP_ARG))
    return ratio.reshape(log_ratio.shape), weight.reshape(log_ratio.shape)


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
):
    """CISPO per token (MiniMax-M1, https://arxiv.org/abs/2506.13585): ``(pg_losses, clipfrac)``.

    ``ratio = exp(−ppo_kl)`` (``ppo_kl = old_log_probs − log_probs``),
    ``ℓ = −sg(clip(ratio, 1 − eps_clip, 1 + eps_clip_high))·A·log_probs``: the gradient flows
    through ``log_probs`` on every token, clipped ones included. ``clipfrac`` is 1.0 where the
    weight is clipped. ``eps_clip >= 1`` sets no lower clip (canonical CISPO), as slime. Any
    shape; unreduced. :func:`rlops.policy_loss` with ``kind="cispo"``, computed in float64 (the
    old log-probs are rebuilt as ``log_probs + ppo_kl``) and returned in the inputs' dtype.

    Differences: the log-ratio is clamped to at most 20 before ``exp``; ``eps_clip`` and
    ``eps_clip_high`` must be > 0 (slime accepts 0 and negative values).

    Example:
        >>> import torch
        >>> pg, frac = compute_cispo_loss(torch.tensor([0.0, -0.5]), torch.tensor([-1.0, -0.5]),
        ...                               torch.tensor([1.0, 1.0]), 0.2, 0.2)
        >>> pg, frac
        (tensor([1.0000, 0.6000]), tensor([0., 1.]))
    """
    check_same_shape("ppo_kl", ppo_kl, log_probs=log_probs, advantages=advantages)
    low = check_positive("eps_clip", eps_clip)
    high = check_positive("eps_clip_high", eps_clip_high)
    dtype = torch.promote_types(
        torch.promote_types(ppo_kl.dtype, log_probs.dtype), advantages.dtype
    )
    logp = _row(log_probs).double()
    old = logp.detach() + _row(ppo_kl).detach().double()
    loss, _ = rlops.policy_loss(
        logp,
        old,
        _row(advantages).double(),
        torch.ones_like(logp, dtype=torch.bool),
        kind="cispo",
        clip_low=math.inf if low >= 1 else low,
        clip_high=high,
        agg=None,
    )
    ratio, weight = _ratios(
        -ppo_kl.double(), 1.0 + high, None if low >= 1 else 1.0 - low, "truncate"
    )
    return loss.reshape(ppo_kl.shape).to(dtype), (weight != ratio).to(dtype)


def _tis_inputs(args, pg_loss, train_log_probs, rollout_log_probs):
    train = _ragged.as_1d_list("train_log_probs", train_log_probs)
    rollouts = _ragged.as_1d_list("rollout_log_probs", rollout_log_probs)
    # equal totals are not enough: the samples must pair up, token for token
    _ragged.check_counts(train_log_probs=train, rollout_log_probs=rollouts)
    for i, (a, b) in enumerate(zip(train, rollouts)):
        if a.numel() != b.numel():
            raise ValueError(
                f"train_log_probs[{i}] has {a.numel()} entries but "
                f"rollout_log_probs[{i}] has {b.numel()}"
            )
    old = torch.cat(train) if train else torch.zeros(0)
    rollout = torch.cat(rollouts) if rollouts else torch.zeros(0)
    check_same_shape(
        "pg_loss",
        pg_loss,
        **{"torch.cat(train_log_probs)": old, "torch.cat(rollout_log_probs)": rollout},
    )
    upper = check_positive("args.tis_clip", args.tis_clip)
    lower = check_nonneg("args.tis_clip_low", getattr(args, "tis_clip_low", 0.0))
    if lower > upper:
        raise ValueError(f"args.tis_clip_low must be <= args.tis_clip, got {lower} > {upper}")
    return old - rollout, upper, (lower or None)


def _tis(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, mode):
    log_ratio, upper, lower = _tis_inputs(args, pg_loss, train_log_probs, rollout_log_probs)
    ratio, weight = _ratios(log_ratio, upper, lower, mode)
    metrics = {
        "tis": ratio.clone(),
        "tis_clipfrac": (weight != ratio).to(ratio.dtype),
        "tis_abs": (ratio - 1).abs(),
    }
    return pg_loss * weight, loss_masks, metrics


def vanilla_tis_function(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs
):
    """Truncated importance sampling (TIS, https://fengyao.notion.site/off-policy-rl):
    ``(pg_loss · w, loss_masks, metrics)``, slime's ``--use-tis`` default.

    Per token of the concatenated samples, ``ρ = exp(train_log_probs − rollout_log_probs)`` and
    ``w = clip(ρ, args.tis_clip_low, args.tis_clip)`` (defaults 0 and 2: no lower bound);
    ``metrics`` are per-token detached tensors (slime reduces them per sample afterwards):
    ``tis`` (``ρ``), ``tis_clipfrac`` (1.0 where ``w != ρ``), ``tis_abs`` (``|ρ − 1|``).
    ``loss_masks`` are returned as given; other keywords (``total_lengths``, ...) are accepted.
    :func:`rlops.rollout_importance_weights` at token level, truncate mode.

    Differences: ``ρ`` is ``exp`` of a log-ratio clamped at 20 (slime: inf beyond ~88 in
    float32); ``args.tis_clip`` must be > 0 and ``args.tis_clip_low`` in ``[0, tis_clip]``;
    ``train_log_probs`` and ``rollout_log_probs`` must hold as many samples, of equal lengths
    (slime concatenates each list unchecked, so lists that only agree in total pair the wrong
    tokens).

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> pg, masks, m = vanilla_tis_function(
        ...     Namespace(tis_clip=2.0, tis_clip_low=0.0), pg_loss=torch.ones(3),
        ...     train_log_probs=[torch.tensor([0.0, 1.0]), torch.tensor([-1.0])],
        ...     rollout_log_probs=[torch.zeros(2), torch.zeros(1)], loss_masks=None)
        >>> pg, m["tis_clipfrac"]
        (tensor([1.0000, 2.0000, 0.3679]), tensor([0., 1., 0.]))
    """
    return _tis(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "truncate")


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """IcePop (Ring-1T): ``(pg_loss · w, loss_masks, metrics)`` with ``w = ρ`` where
    ``args.tis_clip_low <= ρ <= args.tis_clip`` and 0 elsewhere (the token is dropped);
    ``ρ = exp(train_log_probs − rollout_log_probs)`` per token of the concatenated samples.
    Metrics as :func:`vanilla_tis_function` (``tis_clipfrac``: the dropped tokens).
    :func:`rlops.rollout_importance_weights` at token level, mask mode (bounds compared in log
    space).

    Differences: as :func:`vanilla_tis_function`.

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> pg, _, m = icepop_function(
        ...     Namespace(tis_clip=2.0, tis_clip_low=0.5), pg_loss=torch.ones(3),
        ...     train_log_probs=[torch.tensor([0.0, 1.0, -1.0])],
        ...     rollout_log_probs=[torch.zeros(3)], loss_masks=None)
        >>> pg, m["tis_clipfrac"]
        (tensor([1., 0., 0.]), tensor([0., 1., 1.]))
    """
    return _tis(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "mask")


def compute_opsm_mask(args, full_log_probs, full_old_log_probs, advantages, loss_masks):
    """Off-policy sequence masking (OPSM): ``(opsm_mask, opsm_clipfrac)``, slime's ``--use-opsm``.

    Per sample ``i``, with ``w = loss_masks[i]``, the sequence KL
    ``kl_i = Σ_t w_t·(old_t − new_t) / max(Σ_t w_t, 1)`` (``full_old_log_probs[i]``,
    ``full_log_probs[i]``: whole responses). A token of ``advantages[i]`` (this rank's piece) is
    masked (0) where ``A < 0`` and ``kl_i > args.opsm_delta``: negative-advantage tokens of
    samples that drifted too far off policy stop pushing down (:func:`rlops.selection.opsm_mask`,
    which this calls on the padded batch). ``opsm_mask`` is the
    concatenated float32 1/0 mask; ``opsm_clipfrac`` the sum over samples of masked tokens /
    ``max(Σ_t w_t, 1)``. One vectorised pass over the padded ``[B, T]`` batch.

    All of this is slime's code read as written, ``loss_masks`` included: slime multiplies by
    the mask as given, so a weight counts as its value (a 0.5 weighs a token's log-ratio by
    0.5 and counts 0.5 in the denominators, whose floor is 1: weights summing to less than 1
    are divided by 1). Any real weights give a finite, well-defined result there, so they are
    followed rather than refused; a 0/1 mask gives the masked mean. A sample whose weights sum
    to 0 has ``kl_i = 0``, masked only when ``opsm_delta < 0``, as slime.

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> new = [torch.tensor([-2.0, -2.0]), torch.tensor([-1.0])]
        >>> old = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0])]  # kl: 1.0 and 0.0
        >>> adv = [torch.tensor([-1.0, 1.0]), torch.tensor([-1.0])]
        >>> mask, frac = compute_opsm_mask(Namespace(opsm_delta=1e-4), new, old, adv,
        ...                                [torch.ones(2), torch.ones(1)])
        >>> mask, frac
        (tensor([0., 1., 1.]), tensor(0.5000))
    """
    new = _ragged.as_1d_list("full_log_probs", full_log_probs)
    old = _ragged.as_1d_list("full_old_log_probs", full_old_log_probs)
    adv = _ragged.as_1d_list("advantages", advantages)
    masks = _ragged.as_1d_list("loss_masks", loss_masks)
    _ragged.check_counts(
        full_log_probs=new, full_old_log_probs=old, advantages=adv, loss_masks=masks
    )
    delta = as_real("args.opsm_delta", args.opsm_delta)
    if is_nan(delta):
        raise ValueError("args.opsm_delta must be a number, got nan")
    for i, (a, b, m) in enumerate(zip(new, old, masks)):
        if not a.numel() == b.numel() == m.numel():
            raise ValueError(
                f"full_log_probs[{i}], full_old_log_probs[{i}] and loss_masks[{i}] "
                f"must have one entry per response token, got {a.numel()}, "
                f"{b.numel()} and {m.numel()}"
            )
    if not adv:
        return torch.zeros(0), torch.zeros(())
    device = adv[0].device
    n = _ragged.pad([x.detach() for x in new])
    o = _ragged.pad([x.detach().to(n.device) for x in old], n.shape[1])
    w = _ragged.pad([x.detach().to(n.device) for x in masks], n.shape[1])  # zero-padded
    w = w.to(torch.promote_types(torch.promote_types(n.dtype, o.dtype), w.dtype))
    weight = w.sum(-1).clamp_min(1)
    # rlops.opsm_mask takes a 0/1 mask and the plain mean; slime's weighted mean is given to
    # it as each row's log-ratio rescaled (by 1 for a 0/1 mask): the mean over the nonzero
    # weights of (w·(old − new)·count / weight) is Σ w·(old − new) / max(Σ w, 1)
    on = w != 0
    count = on.sum(-1, keepdim=True).clamp_min(1).to(w.dtype)
    scaled = torch.where(on, (o - n) * w * (count / weight[:, None]), 0)
    keep, _ = rlops.selection.opsm_mask(
        torch.zeros_like(scaled), scaled, -torch.ones_like(scaled), on, delta=delta
    )
    # a row with no weight has kl 0: masked only when delta < 0 (slime)
    rejected = torch.where(on.any(-1), ~keep.any(-1), bool(0.0 > delta)).to(device)
    a = _ragged.pad(adv)
    lengths = [x.numel() for x in adv]
    # the right padding is 0, never < 0: no token past a sample's length is masked
    masked = ((a < 0) & rejected[:, None]).float()
    clipfrac = (masked.sum(-1) / weight.to(device=device, dtype=torch.float32)).sum()
    return torch.cat(_ragged.split(1.0 - masked, lengths)), clipfrac
