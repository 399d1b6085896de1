"""verl's policy losses (``core_algos.py``): each one ``rlops.policy_loss`` call; the registry."""

from __future__ import annotations

import math
from typing import Any

import torch

import rlops
from rlops._checks import check_2d, check_choice, check_positive, check_same_shape
from rlops.compat.verl._config import batch_info, config_value, kind_options, response_mask
from rlops.compat.verl._losses import agg_loss
from rlops.compat.verl._rollout import correction_and_rejection
from rlops.losses import AGG_MODES
from rlops.losses.policy import row_geometric_mean

_PAIR = (("pg_clipfrac", "pg_clipfrac"), ("ppo_kl", "ppo_kl"))
_TRIPLE = (*_PAIR, ("pg_clipfrac_lower", "pg_clipfrac_lower"))
# verl's metric keys per kind: (verl key, rlops metric or None for a constant 0.0)
_METRICS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "gspo": (*_PAIR, ("pg_clipfrac_lower", None)),
    "cispo": (*_PAIR, ("pg_clipfrac_lower", None)),
    "sapo": (("pg_clipfrac", None), ("ppo_kl", "ppo_kl"), ("pg_clipfrac_lower", None)),
    "gpg": (),
    "clip_cov": (("pg_clipfrac", "clip_cov_frac"), ("ppo_kl", "ppo_kl")),
    "kl_cov": (("ppo_kl", "ppo_kl_abs"),),
    "geo_mean": _TRIPLE,
    "dppo_tv": _TRIPLE,
    "dppo_kl": _TRIPLE,
}
# verl aggregates these with a fixed mode whatever loss_agg_mode says
_FORCED_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}


def _checked(old_log_prob, log_prob, advantages, mask, rollout_is_weights) -> torch.Tensor:
    """The registered signature's tensors checked under verl's names; the mask as bool."""
    check_2d("old_log_prob", old_log_prob)
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    check_same_shape(
        "old_log_prob", old_log_prob, log_prob=log_prob, advantages=advantages, **weights
    )
    return response_mask(mask, "old_log_prob", old_log_prob)


def _kind_loss(
    kind: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: object,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's registered loss ``kind`` (one name in both) on :func:`rlops.policy_loss`."""
    if config is None:
        raise ValueError(f"config (verl's actor config) must be given for the {kind!r} loss")
    mask = _checked(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    options = kind_options(kind, config)
    if kind == "geo_mean" and rollout_is_weights is not None:
        rollout_is_weights = row_geometric_mean(rollout_is_weights, mask, eps=1e-10)
    loss_mat, metrics = rlops.policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        kind=kind,
        rollout_is_weights=rollout_is_weights,
        agg=None,
        **options,
    )
    if kind == "geo_mean":  # verl: a plain mean over all rows, whatever loss_agg_mode says
        loss = rlops.aggregate_loss(
            loss_mat, mask, "seq-mean-token-mean", num_seqs=max(old_log_prob.shape[0], 1)
        )
    else:
        loss = agg_loss(loss_mat, mask, _FORCED_AGG.get(kind, loss_agg_mode), **batch_info(config))
    out = {}
    for key, source in _METRICS[kind]:
        out[f"actor/{key}"] = 0.0 if source is None else metrics[source].item()
    return loss, out


def _ppo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    names=("cliprange", "cliprange_low", "cliprange_high", "clip_ratio_c"),
    rollout_is_weights=None,
):
    """PPO with dual clip, checked under verl's names (or the config's, ``names``)."""
    mask = _checked(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    clip, low_name, high_name, c_name = names
    if cliprange is None and (cliprange_low is None or cliprange_high is None):
        raise ValueError(f"{clip} (or both {low_name} and {high_name}) must be given")
    low = check_positive(
        clip if cliprange_low is None else low_name,
        cliprange if cliprange_low is None else cliprange_low,
    )
    high = check_positive(
        clip if cliprange_high is None else high_name,
        cliprange if cliprange_high is None else cliprange_high,
    )
    dual = check_positive(c_name, clip_ratio_c, above=1.0)
    loss_mat, metrics = rlops.policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        clip_low=math.inf if low >= 1 else low,  # a ratio floor <= 0 never binds, as in verl
        clip_high=high,
        dual_clip=dual,
        rollout_is_weights=rollout_is_weights,
        agg=None,
    )
    return loss_mat, metrics, mask


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
):
    """PPO's clipped loss with dual clip (https://arxiv.org/abs/1707.06347), verl's 4-tuple.

    Example:
        >>> old = torch.zeros(1, 2)
        >>> loss, clipfrac, ppo_kl, lower = compute_policy_loss(
        ...     old, torch.tensor([[0.5, 0.0]]), torch.ones(1, 2), torch.ones(1, 2), cliprange=0.2)
        >>> loss, clipfrac
        (tensor(-1.1000), tensor(0.5000))
    """
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    loss_mat, metrics, mask = _ppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange,
        cliprange_low,
        cliprange_high,
        clip_ratio_c,
    )
    loss = agg_loss(loss_mat, mask, loss_agg_mode)
    return loss, metrics["pg_clipfrac"], metrics["ppo_kl"], metrics["pg_clipfrac_lower"]


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"vanilla"`` loss: :func:`compute_policy_loss` on the config's ranges.

    Example:
        >>> loss, metrics = compute_policy_loss_vanilla(
        ...     torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"clip_ratio": 0.2})
        >>> loss, metrics["actor/pg_clipfrac"]
        (tensor(-1.), 0.0)
    """
    if config is None:
        raise ValueError("config (the actor config with clip_ratio) must be given")
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    loss_mat, metrics, mask = _ppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        config_value(config, "clip_ratio"),
        config_value(config, "clip_ratio_low"),
        config_value(config, "clip_ratio_high"),
        config_value(config, "clip_ratio_c", 3.0),
        names=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
        rollout_is_weights=rollout_is_weights,
    )
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **batch_info(config))
    return loss, {
        "actor/pg_clipfrac": metrics["pg_clipfrac"].item(),
        "actor/ppo_kl": metrics["ppo_kl"].item(),
        "actor/pg_clipfrac_lower": metrics["pg_clipfrac_lower"].item(),
    }


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"gspo"`` loss (https://arxiv.org/abs/2507.18071), sequence ratios.

    Example:
        >>> loss, m = compute_policy_loss_gspo(torch.zeros(1, 2), torch.zeros(1, 2),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> loss, m["actor/pg_clipfrac"]
        (tensor(-1.), 0.0)
    """
    return _kind_loss(
        "gspo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"sapo"`` loss: ``−A·σ(τ·(r − 1))·4/τ``, ``τ = tau_pos / tau_neg``.

    Example:
        >>> loss, _ = compute_policy_loss_sapo(torch.zeros(1, 1), torch.zeros(1, 1),
        ...     torch.ones(1, 1), torch.ones(1, 1), config={"tau_pos": 1.0, "tau_neg": 1.05})
        >>> loss
        tensor(-2.)
    """
    return _kind_loss(
        "sapo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"gpg"`` loss: ``−A·log π`` per token: ``(pg_loss, {})``.

    Example:
        >>> loss, m = compute_policy_loss_gpg(torch.zeros(1, 2), torch.tensor([[-1.0, -2.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> loss, m
        (tensor(1.5000), {})
    """
    return _kind_loss(
        "gpg",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"clip_cov"`` loss (https://arxiv.org/abs/2505.22617).

    Example:
        >>> loss, m = compute_policy_loss_clip_cov(torch.zeros(1, 2), torch.zeros(1, 2),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> loss, m["actor/pg_clipfrac"]
        (tensor(-1.), 0.0)
    """
    return _kind_loss(
        "clip_cov",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"kl_cov"`` loss (https://arxiv.org/abs/2505.22617).

    Example:
        >>> loss, m = compute_policy_loss_kl_cov(torch.zeros(1, 2), torch.tensor([[0.5, 0.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"policy_loss": {"ppo_kl_coef": 1.0}})
        >>> round(m["actor/ppo_kl"], 4)
        0.25
    """
    return _kind_loss(
        "kl_cov",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"geo_mean"`` loss (GMPO, https://arxiv.org/abs/2507.20673).

    Example:
        >>> loss, m = compute_policy_loss_geo_mean(torch.zeros(1, 2), torch.tensor([[0.2, 0.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.4})
        >>> round(loss.item(), 4)
        -1.1052
    """
    return _kind_loss(
        "geo_mean",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"cispo"`` loss (https://arxiv.org/abs/2506.13585).

    Example:
        >>> loss, m = compute_policy_loss_cispo(torch.zeros(1, 2), torch.tensor([[0.5, -1.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), m["actor/pg_clipfrac"]
        (0.1, 1.0)
    """
    return _kind_loss(
        "cispo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"dppo_tv"`` loss: PPO's trust region by ``π − π_old``.

    Example:
        >>> loss, m = compute_policy_loss_dppo_tv(torch.tensor([[-1.0, -1.0]]),
        ...     torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), m["actor/pg_clipfrac"]
        (0.5, 0.5)
    """
    return _kind_loss(
        "dppo_tv",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"dppo_kl"`` loss: the trust region by the Bernoulli KL.

    Example:
        >>> loss, m = compute_policy_loss_dppo_kl(torch.tensor([[-1.0, -1.0]]),
        ...     torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"clip_ratio": 0.2})
        >>> m["actor/pg_clipfrac"]
        0.0
    """
    return _kind_loss(
        "dppo_kl",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"bypass_mode"`` loss: rollout correction, then ppo_clip or reinforce.

    Example:
        >>> cfg = {"clip_ratio": 0.2, "policy_loss": {"rollout_correction": {
        ...     "loss_type": "reinforce", "rollout_is": "token"}}}
        >>> loss, m = compute_policy_loss_bypass_mode(torch.tensor([[-1.0, -1.0]]),
        ...     torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), torch.ones(1, 2), config=cfg)
        >>> round(loss.item(), 4)
        0.9122
    """
    if config is None:
        raise ValueError("config (verl's actor config) must be given for the bypass_mode loss")
    rc = config_value(config_value(config, "policy_loss"), "rollout_correction")
    if rc is None:
        raise ValueError(
            "config.policy_loss.rollout_correction must be given for loss_mode='bypass_mode' "
            "(as verl)"
        )
    check_2d("log_prob", log_prob)
    loss_type = check_choice(
        "config.policy_loss.rollout_correction.loss_type",
        config_value(rc, "loss_type", "ppo_clip"),
        ("ppo_clip", "reinforce"),
    )
    options: dict[str, Any] = {  # checked by the rollout correction, under these names
        "rollout_is": config_value(rc, "rollout_is"),
        "rollout_is_threshold": config_value(rc, "rollout_is_threshold", 2.0),
        "rollout_is_batch_normalize": config_value(rc, "rollout_is_batch_normalize", False),
        "rollout_rs": config_value(rc, "rollout_rs"),
        "rollout_rs_threshold": config_value(rc, "rollout_rs_threshold"),
    }
    weights, mask, corr = correction_and_rejection(
        log_prob.detach(), old_log_prob, response_mask, **options
    )
    if loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, None
        )
    else:
        loss_mat, m = rlops.policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            mask,
            kind="reinforce",
            rollout_is_weights=weights,
            agg=None,
        )
        loss = agg_loss(loss_mat, mask, loss_agg_mode, **batch_info(config))
        metrics = {"actor/ppo_kl": m["ppo_kl"].item()}
    metrics.update(corr)
    return loss, metrics


#: verl's registered policy-loss names -> adapters (verl's ``dro`` is not adapted).
POLICY_LOSS_REGISTRY = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "bypass_mode": compute_policy_loss_bypass_mode,
}


def get_policy_loss_fn(name: str):
    """The adapter registered as ``name`` (verl's ``core_algos.get_policy_loss_fn``).

    Example:
        >>> get_policy_loss_fn("gspo").__name__
        'compute_policy_loss_gspo'
    """
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"Unsupported loss mode: {name}. Supported modes are: {list(POLICY_LOSS_REGISTRY)}"
            " (verl's dro is not adapted: rlops.policy_loss(kind='dro') is Tinker's form)"
        )
    return POLICY_LOSS_REGISTRY[name]
