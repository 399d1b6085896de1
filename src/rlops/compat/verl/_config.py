"""Reading verl's inputs and actor config as verl does (absent keys take verl's defaults)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlops._checks import (
    as_bool_mask,
    as_real,
    check_2d,
    check_fraction,
    check_nonneg,
    check_positive,
)


def config_value(config: object, name: str, default: object = None) -> object:
    """``config[name]`` or ``config.name``; ``default`` when absent, as ``config.get``."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def batch_info(config: object) -> Mapping:
    """``config.global_batch_info``: the keywords verl passes to ``agg_loss``."""
    info = config_value(config, "global_batch_info", {})
    if not isinstance(info, Mapping):
        raise TypeError(
            "config.global_batch_info must be a mapping of agg_loss keywords "
            f"(dp_size, batch_num_tokens, ...), got {type(info).__name__}"
        )
    return info


def response_mask(mask: object, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """verl's ``response_mask``: a 0/1 tensor of the shape of ``like``, as bool."""
    return as_bool_mask("response_mask", mask, like.shape, like_name, like)


def outcome_inputs(token_level_rewards: object, mask: object) -> torch.Tensor:
    """``token_level_rewards`` ``[bs, T]`` checked; its ``response_mask`` returned as bool."""
    rewards = check_2d("token_level_rewards", token_level_rewards)
    return response_mask(mask, "token_level_rewards", rewards)


def group_ids(index: object, device: torch.device) -> torch.Tensor:
    """verl's ``index`` (an array of uids, often strings) as integer group ids ``[bs]``."""
    if isinstance(index, torch.Tensor) and not index.is_floating_point():
        return index.to(device)
    import numpy as np  # verl passes numpy arrays of uids; numpy comes with verl

    ids = np.unique(np.asarray(index), return_inverse=True)[1]
    return torch.as_tensor(ids.reshape(-1), device=device)


def _clip_pair(config: object, log_space: bool = False) -> dict[str, float]:
    """``clip_ratio_low`` / ``_high`` (default ``clip_ratio``); a floor <= 0 means none."""
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
    """``config.policy_loss.name``, ``default`` when absent or None."""
    pl = config_value(config, "policy_loss", {})
    if pl is None:
        raise ValueError("config.policy_loss must not be None (verl asserts it is set)")
    value = config_value(pl, name)
    return default if value is None else value


def _clip_cov_options(config: object) -> dict[str, Any]:
    """``clip_cov``'s ``policy_loss.clip_cov_lb`` / ``_ub`` / ``_ratio`` and the clip pair."""
    lb = as_real("config.policy_loss.clip_cov_lb", _policy_loss_option(config, "clip_cov_lb", 1.0))
    ub = as_real("config.policy_loss.clip_cov_ub", _policy_loss_option(config, "clip_cov_ub", 5.0))
    if not lb < ub:
        raise ValueError(
            "config.policy_loss.clip_cov_lb must be < config.policy_loss."
            f"clip_cov_ub, got {lb} and {ub}"
        )
    ratio = _policy_loss_option(config, "clip_cov_ratio", 2e-4)
    return {
        **_clip_pair(config),
        "clip_cov_lb": lb,
        "clip_cov_ub": ub,
        "clip_cov_ratio": check_fraction("config.policy_loss.clip_cov_ratio", ratio),
    }


def kind_options(kind: str, config: object) -> dict[str, Any]:
    """The :func:`rlops.policy_loss` options of verl's registered loss ``kind``, from its config."""
    if kind in ("gspo", "cispo"):
        return _clip_pair(config)
    if kind == "geo_mean":
        return _clip_pair(config, log_space=True)
    if kind in ("dppo_tv", "dppo_kl"):  # divergence bounds, any > 0; verl's TIS cap at 20
        c = config_value(config, "clip_ratio_c", 20.0)
        return {
            **_clip_pair(config, log_space=True),
            "clip_ratio_c": check_positive("config.clip_ratio_c", c),
        }
    if kind == "sapo":
        return {
            "tau_pos": check_positive("config.tau_pos", config_value(config, "tau_pos", 1.0)),
            "tau_neg": check_positive("config.tau_neg", config_value(config, "tau_neg", 1.05)),
        }
    if kind == "clip_cov":
        return _clip_cov_options(config)
    if kind == "kl_cov":
        ratio = _policy_loss_option(config, "kl_cov_ratio", 2e-4)
        coef = _policy_loss_option(config, "ppo_kl_coef", 1.0)
        return {
            "kl_cov_ratio": check_fraction("config.policy_loss.kl_cov_ratio", ratio),
            "ppo_kl_coef": check_nonneg("config.policy_loss.ppo_kl_coef", coef),
        }
    return {}
