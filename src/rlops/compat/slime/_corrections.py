"""slime's rollout corrections: TIS, IcePop (``megatron_utils/loss.py``) and OPSM."""

from __future__ import annotations

import torch

import rlops
from rlops._checks import as_real, check_nonneg, check_positive, check_same_shape, is_nan
from rlops._numerics import MAX_EXP_ARG
from rlops.compat import _ragged


def token_ratios(log_ratio: torch.Tensor, upper: float, lower: float | None, mode: str):
    """``(ratio, weight)`` per token: the IS weight and the ratio saturated as it is."""
    lr = log_ratio.detach().reshape(1, -1)
    everywhere = torch.ones_like(lr, dtype=torch.bool)
    weight = rlops.rollout_importance_weights(
        lr, torch.zeros_like(lr), everywhere, mode=mode, threshold=upper, low=lower
    )[0]
    ratio = torch.exp(lr.to(weight.dtype).clamp_max(MAX_EXP_ARG))
    return ratio.reshape(log_ratio.shape), weight.reshape(log_ratio.shape)


def _tis_inputs(args, pg_loss, train_log_probs, rollout_log_probs):
    """TIS's lists paired token for token: ``(log_ratio, upper, lower or None)``."""
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
    """TIS (``mode="truncate"``) or IcePop (``"mask"``): slime's return triple."""
    log_ratio, upper, lower = _tis_inputs(args, pg_loss, train_log_probs, rollout_log_probs)
    ratio, weight = token_ratios(log_ratio, upper, lower, mode)
    metrics = {
        "tis": ratio.clone(),
        "tis_clipfrac": (weight != ratio).to(ratio.dtype),
        "tis_abs": (ratio - 1).abs(),
    }
    return pg_loss * weight, loss_masks, metrics


def vanilla_tis_function(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs
):
    """TIS (https://fengyao.notion.site/off-policy-rl): ``pg_loss·clip(ρ, tis_clip_low, tis_clip)``.

    Example:
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
    """IcePop: :func:`vanilla_tis_function` with ``w = ρ`` in ``[tis_clip_low, tis_clip]``, else 0.

    Example:
        >>> from argparse import Namespace
        >>> args = Namespace(tis_clip=2.0, tis_clip_low=0.5)
        >>> pg, _, m = icepop_function(args, pg_loss=torch.ones(3), loss_masks=None,
        ... train_log_probs=[torch.tensor([0.0, 1.0, -1.0])], rollout_log_probs=[torch.zeros(3)])
        >>> pg, m["tis_clipfrac"]
        (tensor([1., 0., 0.]), tensor([0., 1., 1.]))
    """
    return _tis(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "mask")


def compute_opsm_mask(args, full_log_probs, full_old_log_probs, advantages, loss_masks):
    """Off-policy sequence masking: ``(opsm_mask, opsm_clipfrac)``, as slime's ``--use-opsm``.

    Example:
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
    keep, _ = rlops.opsm_mask(
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
