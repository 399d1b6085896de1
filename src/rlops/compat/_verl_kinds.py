"""verl's registered policy losses (``POLICY_LOSS_REGISTRY``) on :func:`rlops.policy_loss`.

Each adapter has verl's registered signature ``(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights) -> (pg_loss, metrics)``, reads the
options from verl's actor config under verl's names (``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``, ``tau_neg``, ``policy_loss.clip_cov_ratio`` /
``clip_cov_lb`` / ``clip_cov_ub``, ``policy_loss.kl_cov_ratio`` / ``ppo_kl_coef``,
``global_batch_info``), computes the per-token loss with one :func:`rlops.policy_loss` call
(``agg=None``) and aggregates it as verl does. Metrics are Python floats under verl's keys.
:mod:`rlops.compat.verl` defines the registered functions (and their docstrings) on
:func:`kind_loss`.

Reading the config (:func:`config_value`) follows verl: a key that is absent takes verl's default
(its ``ActorConfig`` field default); a key set to ``None`` reads ``None``, which falls back to the
default only where verl writes ``x if x is not None else default`` (``clip_ratio_low`` /
``clip_ratio_high`` to ``clip_ratio``, the ``policy_loss.*`` options) and is an error, naming the
key, where verl would fail on it (``tau_pos``, ``clip_ratio_c``, ``global_batch_info``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_real,
    check_2d,
    check_choice,
    check_fraction,
    check_nonneg,
    check_positive,
    check_same_shape,
)
from rlops.losses import AGG_MODES
from rlops.losses.policy import row_geometric_mean

__all__ = ["batch_info", "config_value", "kind_loss"]


def config_value(config: object, name: str, default: object = None) -> object:
    """``config[name]`` for mappings (dict, OmegaConf ``DictConfig``), else ``config.name``
    (dataclass, namespace): ``default`` when the key is absent (or ``config`` is ``None``), the
    value as set otherwise, ``None`` included, as verl's ``config.get(name, default)`` reads."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def batch_info(config: object) -> Mapping:
    """``config.global_batch_info``: the keywords verl passes to ``agg_loss`` (``{}`` when
    absent, as verl's ``ActorConfig`` default)."""
    info = config_value(config, "global_batch_info", {})
    if not isinstance(info, Mapping):
        raise TypeError(
            "config.global_batch_info must be a mapping of agg_loss keywords "
            f"(dp_size, batch_num_tokens, ...), got {type(info).__name__}"
        )
    return info


def _clip_pair(config: object, log_space: bool = False) -> dict[str, float]:
    """verl's clip ranges: ``clip_ratio_low`` / ``clip_ratio_high``, each defaulting to
    ``clip_ratio``; checked under those names. A ratio floor ``1 − low <= 0`` never binds (as in
    verl): no lower clip. ``log_space`` (geo_mean): both are log-space bounds, any > 0."""
    clip = config_value(config, "clip_ratio")
    out = {}
    for side, name in (("clip_low", "clip_ratio_low"), ("clip_high", "clip_ratio_high")):
        value, label = config_value(config, name), name
        if value is None:
            value, label = clip, "clip_ratio"
        if value is None:
            raise ValueError(f"config.{name} (or config.clip_ratio) must be given")
        value = check_positive(f"config.{label}", value)
        if side == "clip_low" and value >= 1 and not log_space:
            value = math.inf
        out[side] = value
    return out


def _policy_loss_option(config: object, name: str, default: float) -> object:
    """``config.policy_loss.name``, ``default`` when absent or ``None`` (verl: ``x if x is not
    None else default``); ``config.policy_loss`` itself defaults to verl's defaults when absent
    and must not be ``None`` (verl asserts it)."""
    pl = config_value(config, "policy_loss", {})
    if pl is None:
        raise ValueError("config.policy_loss must not be None (verl asserts it is set)")
    value = config_value(pl, name)
    return default if value is None else value


def _options(kind: str, config: object) -> dict[str, Any]:
    """The rlops options of ``kind`` from verl's actor config."""
    if kind in ("gspo", "cispo"):
        return _clip_pair(config)
    if kind == "geo_mean":
        return _clip_pair(config, log_space=True)
    if kind in ("dppo_tv", "dppo_kl"):  # divergence bounds, any > 0; verl's TIS cap at 20
        return {
            **_clip_pair(config, log_space=True),
            "clip_ratio_c": check_positive(
                "config.clip_ratio_c", config_value(config, "clip_ratio_c", 20.0)
            ),
        }
    if kind == "sapo":
        return {
            "tau_pos": check_positive("config.tau_pos", config_value(config, "tau_pos", 1.0)),
            "tau_neg": check_positive("config.tau_neg", config_value(config, "tau_neg", 1.05)),
        }
    if kind == "clip_cov":
        lb = as_real(
            "config.policy_loss.clip_cov_lb", _policy_loss_option(config, "clip_cov_lb", 1.0)
        )
        ub = as_real(
            "config.policy_loss.clip_cov_ub", _policy_loss_option(config, "clip_cov_ub", 5.0)
        )
        if not lb < ub:
            raise ValueError(
                "config.policy_loss.clip_cov_lb must be < config.policy_loss."
                f"clip_cov_ub, got {lb} and {ub}"
            )
        return {
            **_clip_pair(config),
            "clip_cov_lb": lb,
            "clip_cov_ub": ub,
            "clip_cov_ratio": check_fraction(
                "config.policy_loss.clip_cov_ratio",
                _policy_loss_option(config, "clip_cov_ratio", 2e-4),
            ),
        }
    if kind == "kl_cov":
        return {
            "kl_cov_ratio": check_fraction(
                "config.policy_loss.kl_cov_ratio", _policy_loss_option(config, "kl_cov_ratio", 2e-4)
            ),
            "ppo_kl_coef": check_nonneg(
                "config.policy_loss.ppo_kl_coef", _policy_loss_option(config, "ppo_kl_coef", 1.0)
            ),
        }
    return {}


# verl's metric keys per kind: (verl key, rlops metric or a constant 0.0)
_METRICS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "gspo": (("pg_clipfrac", "pg_clipfrac"), ("ppo_kl", "ppo_kl"), ("pg_clipfrac_lower", None)),
    "cispo": (("pg_clipfrac", "pg_clipfrac"), ("ppo_kl", "ppo_kl"), ("pg_clipfrac_lower", None)),
    "sapo": (("pg_clipfrac", None), ("ppo_kl", "ppo_kl"), ("pg_clipfrac_lower", None)),
    "gpg": (),
    "clip_cov": (("pg_clipfrac", "clip_cov_frac"), ("ppo_kl", "ppo_kl")),
    "kl_cov": (("ppo_kl", "ppo_kl_abs"),),
    "geo_mean": (
        ("pg_clipfrac", "pg_clipfrac"),
        ("ppo_kl", "ppo_kl"),
        ("pg_clipfrac_lower", "pg_clipfrac_lower"),
    ),
    "dppo_tv": (
        ("pg_clipfrac", "pg_clipfrac"),
        ("ppo_kl", "ppo_kl"),
        ("pg_clipfrac_lower", "pg_clipfrac_lower"),
    ),
    "dppo_kl": (
        ("pg_clipfrac", "pg_clipfrac"),
        ("ppo_kl", "ppo_kl"),
        ("pg_clipfrac_lower", "pg_clipfrac_lower"),
    ),
}
# verl aggregates these with a fixed mode whatever loss_agg_mode says
_FORCED_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}


def kind_loss(
    kind: str,
    agg_loss: Callable,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: object,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's registered loss ``kind`` (one name in both) on :func:`rlops.policy_loss`:
    ``(pg_loss, metrics)``. ``agg_loss`` is :func:`rlops.compat.verl.agg_loss`; the arguments
    after it are those of verl's registered signature."""
    if config is None:
        raise ValueError(f"config (verl's actor config) must be given for the {kind!r} loss")
    check_2d("old_log_prob", old_log_prob)
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    check_same_shape(
        "old_log_prob", old_log_prob, log_prob=log_prob, advantages=advantages, **weights
    )
    mask = as_bool_mask(
        "response_mask", response_mask, old_log_prob.shape, "old_log_prob", old_log_prob
    )
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    options = _options(kind, config)
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
