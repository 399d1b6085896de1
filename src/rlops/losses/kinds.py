"""The per-token loss matrix of each policy-loss kind, and each kind's options.

Every function takes the masked inputs (0 on mask-0 tokens, already in the computation dtype):
``lp`` = log π, ``lr`` = log π − log π_old, ``adv`` = A, the bool ``keep``, and the kind's
checked options; it returns ``ℓ`` (0 on mask-0 tokens) and the sums of its metrics. Ratios
stay in log space until one ``exp`` of an argument clamped to ``≤ MAX_EXP_ARG``.
:func:`rlops.losses.policy_loss` states the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlops._checks import as_real, check_nonneg, check_positive
from rlops.losses._common import MAX_EXP_ARG

__all__ = ["KIND_OPTIONS", "POLICY_KINDS", "check_options", "token_losses"]

# (per-token loss, metric name -> (sum, "tokens" | "rows")): a metric is its sum over the
# action tokens (or the rows that have one) divided by their number.
Out = tuple[torch.Tensor, dict[str, tuple[torch.Tensor, str]]]


# --------------------------------------------------------------------------- options
def _ratio_floor(name: str, v: object) -> float:
    v = check_positive(name, v)
    if 1 <= v < math.inf:
        raise ValueError(
            f"{name} must be < 1 (the ratio floor 1 - {name} must stay positive) or inf "
            f"(no lower clip), got {v}"
        )
    return v


def _finite_positive(name: str, v: object) -> float:
    v = check_positive(name, v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _fraction(name: str, v: object) -> float:
    v = check_positive(name, v)
    if v > 1:
        raise ValueError(f"{name} must be in (0, 1] (a fraction of the action tokens), got {v}")
    return v


def _real(name: str, v: object) -> float:
    v = as_real(name, v)
    if math.isnan(v):
        raise ValueError(f"{name} must be a number, got nan")
    return v


def _dual(name: str, v: object) -> float | None:
    return None if v is None else check_positive(name, v, above=1.0)


def _generator(name: str, v: object) -> torch.Generator | None:
    if v is not None and not isinstance(v, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(v).__name__}")
    return v


# kind -> option -> (default, check). clip_high=None means clip_low when clip_low is given.
KIND_OPTIONS: dict[str, dict[str, tuple[object, Callable]]] = {
    "ppo": {"clip_low": (0.2, _ratio_floor), "clip_high": (None, check_positive),
            "dual_clip": (None, _dual)},
    "reinforce": {},
    "gpg": {},
    "gspo": {"clip_low": (3e-4, _ratio_floor), "clip_high": (4e-4, check_positive)},
    "cispo": {"clip_low": (0.2, _ratio_floor), "clip_high": (None, check_positive)},
    "sapo": {"tau_pos": (1.0, _finite_positive), "tau_neg": (1.05, _finite_positive)},
    "clip_cov": {"clip_low": (0.2, _ratio_floor), "clip_high": (None, check_positive),
                 "clip_cov_ratio": (2e-4, _fraction), "clip_cov_lb": (1.0, _real),
                 "clip_cov_ub": (5.0, _real), "generator": (None, _generator)},
    "kl_cov": {"kl_cov_ratio": (2e-4, _fraction), "ppo_kl_coef": (1.0, check_nonneg)},
    "geo_mean": {"clip_low": (0.4, check_positive), "clip_high": (None, check_positive)},
}
POLICY_KINDS = tuple(KIND_OPTIONS)


def check_options(kind: str, given: dict[str, object]) -> dict[str, object]:
    """The kind's options: defaults, overridden by ``given`` (each checked by name)."""
    spec = KIND_OPTIONS[kind]
    unknown = sorted(set(given) - set(spec))
    if unknown:
        raise TypeError(
            f"policy_loss(kind={kind!r}) got unknown option(s) {unknown}; "
            f"its options are {sorted(spec) or 'none'}"
        )
    out = {}
    for name, (default, check) in spec.items():
        value = given.get(name, default)
        if name == "clip_high" and "clip_high" not in given and "clip_low" in given:
            value = None  # clip_high follows a given clip_low
        nullable = default is None or name == "clip_high"
        out[name] = None if value is None and nullable else check(name, value)
    if "clip_high" in out and out["clip_high"] is None:
        out["clip_high"] = out["clip_low"]
    if kind == "clip_cov" and not out["clip_cov_lb"] < out["clip_cov_ub"]:
        raise ValueError(
            "clip_cov_lb must be < clip_cov_ub, got "
            f"{out['clip_cov_lb']} and {out['clip_cov_ub']}"
        )
    return out


# --------------------------------------------------------------------------- helpers
def _hits(flag: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The number of action tokens where ``flag`` holds, as a metric sum over tokens."""
    return (flag & keep).sum(), "tokens"


def _exp(log: torch.Tensor) -> torch.Tensor:
    return torch.exp(log.clamp_max(MAX_EXP_ARG))


def _row_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` mean over each row's action tokens (``x`` is 0 elsewhere; 0 for an empty row)."""
    return x.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).to(x.dtype).clamp_min(1)


def _batch_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return x.sum() / keep.sum().to(x.dtype).clamp_min(1)


def _clip_max(ratio, adv, clip_low, clip_high):
    """PPO's pessimistic max of the unclipped and clipped terms, and where the clip binds."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _rank(keys: torch.Tensor) -> torch.Tensor:
    """Position of each entry of ``keys`` in ascending order (ties by index), same shape."""
    flat = keys.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return rank.reshape(keys.shape)


def _quota(ratio: float, keep: torch.Tensor) -> torch.Tensor:
    """``max(floor(ratio·N), 1)`` with ``N`` the action tokens, as a device tensor (float64, as
    Python's ``int(ratio * N)``)."""
    n = keep.sum().to(torch.float64)
    return torch.floor(n * ratio).clamp_min(1).to(torch.int64)


def _centred_cov(lp: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-token ``(A − mean A)·(log π − mean log π)`` with means over the action tokens;
    detached."""
    a, p = adv.detach(), lp.detach()
    return (a - _batch_mean(a, keep)) * (p - _batch_mean(p, keep))


# --------------------------------------------------------------------------- kinds
def _ppo(lp, lr, adv, keep, dtype, clip_low, clip_high, dual_clip) -> Out:
    loss, hit = _clip_max(_exp(lr), adv, clip_low, clip_high)
    sums = {"pg_clipfrac": _hits(hit, keep)}
    if dual_clip is not None:
        bound = -adv * dual_clip
        sums["pg_clipfrac_lower"] = _hits((adv < 0) & (loss > bound), keep)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, sums


def _reinforce(lp, lr, adv, keep, dtype) -> Out:
    return -adv * lp, {}


def _gspo(lp, lr, adv, keep, dtype, clip_low, clip_high) -> Out:
    log_s = _row_mean(lr, keep).detach()  # log s_i: mean log-ratio over the row's actions
    ratio = _exp(log_s + (lp - lp.detach()))  # value s_i, gradient s_i·∇log π_t
    loss, hit = _clip_max(ratio, adv, clip_low, clip_high)
    loss = torch.where(keep, loss, 0)  # the row's s_i (NaN from one token) stays off mask 0
    seq_ratio = torch.exp(log_s.squeeze(-1).clamp_max(MAX_EXP_ARG))
    rows = keep.any(-1)
    return loss, {"pg_clipfrac": _hits(hit, keep),
                  "seq_ratio_mean": ((seq_ratio * rows).sum(), "rows")}


def _cispo(lp, lr, adv, keep, dtype, clip_low, clip_high) -> Out:
    ratio = _exp(lr).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * adv * lp, {"pg_clipfrac": _hits(weight != ratio, keep)}


def _sapo(lp, lr, adv, keep, dtype, tau_pos, tau_neg) -> Out:
    ratio = _exp(lr)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    return -gate * adv, {}


def _clip_cov(lp, lr, adv, keep, dtype, clip_low, clip_high, clip_cov_ratio, clip_cov_lb,
              clip_cov_ub, generator) -> Out:
    loss, hit = _clip_max(_exp(lr), adv, clip_low, clip_high)
    cov = _centred_cov(lp, adv, keep)
    cand = keep & ~hit & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    # A uniformly random subset of min(quota, #candidates) candidates: the candidates with the
    # smallest of iid uniform keys (the others are keyed 2, after every candidate).
    keys = torch.rand(keep.shape, generator=generator, dtype=torch.float64, device=keep.device)
    chosen = cand & (_rank(torch.where(cand, keys, 2.0)) < _quota(clip_cov_ratio, keep))
    loss = torch.where(chosen, 0, loss)
    return loss, {"pg_clipfrac": _hits(hit, keep), "clip_cov_frac": _hits(chosen, keep)}


def _kl_cov(lp, lr, adv, keep, dtype, kl_cov_ratio, ppo_kl_coef) -> Out:
    cov = _centred_cov(lp, adv, keep)
    # The quota of action tokens with the largest covariance (ties: the earlier token).
    keys = torch.where(keep, -cov, math.inf)
    chosen = keep & (_rank(keys) < _quota(kl_cov_ratio, keep))
    loss = -adv * _exp(lr) + torch.where(chosen, ppo_kl_coef * lr.abs(), 0)
    return loss, {"kl_cov_frac": _hits(chosen, keep),
                  "ppo_kl_abs": (lr.detach().abs().sum(), "tokens")}


def _geo_mean(lp, lr, adv, keep, dtype, clip_low, clip_high) -> Out:
    sign = torch.sign(adv)
    lr_clamped = lr.clamp(-clip_low, clip_high)
    # Pessimistic clip in log space: min for A > 0, max for A < 0, 0 where A == 0 (as GMPO).
    lr_clip = sign * torch.minimum(sign * lr, sign * lr_clamped)
    log_r = _row_mean(lr_clip, keep).detach()  # log of the row's geometric-mean ratio
    ratio = _exp(log_r + (lr_clip - lr_clip.detach()))
    out = lr != lr_clamped
    loss = torch.where(keep, -adv * ratio, 0)  # the row's R_i (NaN from one token) stays off mask 0
    return loss, {"pg_clipfrac": _hits(out & (adv > 0), keep),
                          "pg_clipfrac_lower": _hits(out & (adv < 0), keep)}


_KINDS: dict[str, Callable[..., Out]] = {
    "ppo": _ppo,
    "reinforce": _reinforce,
    "gpg": _reinforce,
    "gspo": _gspo,
    "cispo": _cispo,
    "sapo": _sapo,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "geo_mean": _geo_mean,
}


def token_losses(kind: str, lp, lr, adv, keep, dtype, options: dict) -> Out:
    """The per-token loss of ``kind`` and its metrics (see the module docstring)."""
    return _KINDS[kind](lp, lr, adv, keep, dtype, **options)
