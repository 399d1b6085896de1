"""The losses' argument checks, on :mod:`rlops._checks`: aggregation modes and normalisers,
the entropy coefficient, every policy-loss kind's options (``KIND_OPTIONS``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch

from rlops._checks import (
    as_real,
    check_choice,
    check_count,
    check_finite_positive,
    check_fraction,
    check_generator,
    check_nonneg,
    check_positive,
    check_real,
    check_same_device,
    is_finite,
    shape_error,
)
from rlops._types import Group
from rlops.distributed.groups import group_rank_size

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


# --------------------------------------------------------------------------- aggregation
def check_agg(
    name: str, mode: object, loss_scale_factor: object, *, optional: bool = True
) -> float | None:
    """Check an aggregation mode (None where ``optional``) and return its normaliser."""
    if mode is not None or not optional:
        check_choice(name, mode, AGG_MODES)
    if loss_scale_factor is None:
        return None
    return check_positive("loss_scale_factor", loss_scale_factor)


def check_normalisers(
    num_tokens: object, num_seqs: object, group: Group, ref: torch.Tensor
) -> tuple[float | torch.Tensor | None, float | torch.Tensor | None]:
    """The checked global counts (``group`` excludes them; ``ref``: the loss input)."""
    num_tokens = check_count("num_tokens", num_tokens, ref)
    num_seqs = check_count("num_seqs", num_seqs, ref)
    if group is not None:
        group_rank_size(group)
        if num_tokens is not None or num_seqs is not None:
            raise ValueError(
                "give either group (one micro-batch per rank: the counts are summed over it) "
                "or num_tokens/num_seqs (the global counts), not both"
            )
    return num_tokens, num_seqs


def check_coef(coef: object, ref: torch.Tensor) -> float | torch.Tensor:
    """A finite number, or a 0-dim floating tensor on ``ref``'s device (never read)."""
    if isinstance(coef, torch.Tensor):
        if coef.dim() != 0:
            raise shape_error("coef", "[] (a scalar)", coef.shape)
        if not coef.is_floating_point():
            raise TypeError(f"coef must be a real floating tensor or a number, got {coef.dtype}")
        check_same_device("entropy", ref, coef=coef)
        return coef
    value = as_real("coef", coef)
    if not is_finite(value):
        raise ValueError(f"coef must be a finite number, got {coef}")
    return value


# --------------------------------------------------------------------------- policy kinds
def _ratio_floor(name: str, v: object) -> float:
    v = check_positive(name, v)
    if 1 <= v < math.inf:
        raise ValueError(
            f"{name} must be < 1 (the ratio floor 1 - {name} must stay positive) or inf "
            f"(no lower clip), got {v}"
        )
    return v


def _dual(name: str, v: object) -> float | None:
    return None if v is None else check_positive(name, v, above=1.0)


def _level(name: str, v: object) -> str:
    return check_choice(name, v, RATIO_LEVELS)


def _real_finite(name: str, v: object) -> float:
    v = check_real(name, v)
    if not is_finite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    return v


#: where a ratio is formed: per token, or the row's geometric mean (GSPO's s_i)
RATIO_LEVELS = ("token", "sequence")


_CLIP: dict[str, tuple[object, Callable]] = {
    "clip_low": (0.2, _ratio_floor),
    "clip_high": (None, check_positive),
}
# kind -> option -> (default, check). clip_high=None means clip_low when clip_low is given.
KIND_OPTIONS: dict[str, dict[str, tuple[object, Callable]]] = {
    "ppo": {**_CLIP, "dual_clip": (None, _dual)},
    "reinforce": {},
    "gpg": {},
    "gspo": {
        "clip_low": (3e-4, _ratio_floor),
        "clip_high": (4e-4, check_positive),
        "dual_clip": (None, _dual),
    },
    "cispo": {**_CLIP, "level": ("token", _level)},
    "sapo": {
        "tau_pos": (1.0, check_finite_positive),
        "tau_neg": (1.05, check_finite_positive),
        "level": ("token", _level),
    },
    "clip_cov": {
        **_CLIP,
        "clip_cov_ratio": (2e-4, check_fraction),
        "clip_cov_lb": (1.0, check_real),
        "clip_cov_ub": (5.0, check_real),
        "generator": (None, check_generator),
    },
    "kl_cov": {"kl_cov_ratio": (2e-4, check_fraction), "ppo_kl_coef": (1.0, check_nonneg)},
    "geo_mean": {"clip_low": (0.4, check_positive), "clip_high": (None, check_positive)},
    "luspo": {"clip_low": (2e-3, _ratio_floor), "clip_high": (2.5e-3, check_positive)},
    "vespo": {
        "k_pos": (2.0, _real_finite),
        "lambda_pos": (3.0, check_finite_positive),
        "k_neg": (3.0, _real_finite),
        "lambda_neg": (2.0, check_finite_positive),
    },
    "dppo_tv": {
        "clip_low": (0.2, check_positive),
        "clip_high": (None, check_positive),
        "clip_ratio_c": (20.0, check_positive),
    },
    "dppo_kl": {
        "clip_low": (0.2, check_positive),
        "clip_high": (None, check_positive),
        "clip_ratio_c": (20.0, check_positive),
    },
    "dro": {"dro_beta": (1.0, check_nonneg)},
    "ipo": {
        "ipo_threshold": (0.1, check_nonneg),
        "adv_tau": (1.0, check_nonneg),
        "kl_tau": (1e-3, check_nonneg),
    },
    "topr": {"positive_weight": (1.0, check_nonneg), "negative_weight": (1.0, check_nonneg)},
}


def check_options(kind: str, given: dict[str, object]) -> dict[str, object]:
    """The kind's options: defaults, overridden by ``given`` (each checked by name)."""
    spec = KIND_OPTIONS[kind]
    unknown = sorted(set(given) - set(spec))
    if unknown:
        raise TypeError(
            f"policy_loss(kind={kind!r}) got unknown option(s) {unknown}; "
            f"its options are {sorted(spec) or 'none'}"
        )
    out: dict[str, object] = {}
    for name, (default, check) in spec.items():
        value = given.get(name, default)
        if name == "clip_high" and "clip_high" not in given and "clip_low" in given:
            value = None  # clip_high follows a given clip_low
        nullable = default is None or name == "clip_high"
        out[name] = None if value is None and nullable else check(name, value)
    if "clip_high" in out and out["clip_high"] is None:
        out["clip_high"] = out["clip_low"]
    if kind == "clip_cov":
        # both passed check_real above
        lb, ub = cast(float, out["clip_cov_lb"]), cast(float, out["clip_cov_ub"])
        if not lb < ub:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {lb} and {ub}")
    return out
