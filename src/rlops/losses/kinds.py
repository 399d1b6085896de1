"""Each policy-loss kind's per-token loss ``ℓ`` and metric sums, from masked inputs; row
quantities through ``rows`` only (design: docs/design/losses.md, "Policy-loss kinds")."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlops.losses._common import MAX_EXP_ARG

__all__ = ["CP_INEXACT", "POLICY_KINDS", "token_losses"]

# (per-token loss, metric name -> (sum, "tokens" | "rows")): a metric is its sum over the
# action tokens (or the rows that have one) divided by their number.
Out = tuple[torch.Tensor, dict[str, tuple[torch.Tensor, str]]]


# --------------------------------------------------------------------------- helpers
def _hits(flag: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The number of action tokens where ``flag`` holds, as a metric sum over tokens."""
    return (flag & keep).sum(), "tokens"


def _exp(log: torch.Tensor) -> torch.Tensor:
    return torch.exp(log.clamp_max(MAX_EXP_ARG))


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
    """Detached ``(A − mean A)·(log π − mean log π)`` over the action tokens."""
    a, p = adv.detach(), lp.detach()
    return (a - _batch_mean(a, keep)) * (p - _batch_mean(p, keep))


# --------------------------------------------------------------------------- kinds
def _ppo(lp, lr, adv, rows, clip_low, clip_high, dual_clip) -> Out:
    keep = rows.keep
    loss, hit = _clip_max(_exp(lr), adv, clip_low, clip_high)
    sums = {"pg_clipfrac": _hits(hit, keep)}
    if dual_clip is not None:
        bound = -adv * dual_clip
        sums["pg_clipfrac_lower"] = _hits((adv < 0) & (loss > bound), keep)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, sums


def _reinforce(lp, lr, adv, rows) -> Out:
    return -adv * lp, {}


def _seq_ratio(lp, lr, rows):
    """GSPO-token's ratio ``sg(s_i)·π_t/sg(π_t)`` (value the row's ``s_i = exp(mean_i lr)``,
    gradient ``s_i·∇log π_t``) and ``log s_i`` (``[B, K]``, detached, whole rows)."""
    (log_s,) = rows.means(lr)  # log s_i: mean log-ratio over the whole row's actions, [B, K]
    return _exp(rows.per_token(log_s) + (lp - lp.detach())), log_s


def _seq_ratio_mean(log_s, rows) -> tuple[torch.Tensor, str]:
    """The mean sequence ratio over the rows with an action token, as a metric sum."""
    return (torch.exp(log_s.clamp_max(MAX_EXP_ARG)) * rows.counted).sum(), "rows"


def _dual_clip(loss, adv, keep, dual_clip, sums):
    """Dual clip (https://arxiv.org/abs/1912.09729): ``min(loss, −A·c)`` where ``A < 0``."""
    if dual_clip is None:
        return loss
    bound = -adv * dual_clip
    sums["pg_clipfrac_lower"] = _hits((adv < 0) & (loss > bound), keep)
    return torch.where(adv < 0, torch.minimum(loss, bound), loss)


def _gspo(lp, lr, adv, rows, clip_low, clip_high, dual_clip=None) -> Out:
    keep = rows.keep
    ratio, log_s = _seq_ratio(lp, lr, rows)
    loss, hit = _clip_max(ratio, adv, clip_low, clip_high)
    sums = {"pg_clipfrac": _hits(hit, keep), "seq_ratio_mean": _seq_ratio_mean(log_s, rows)}
    loss = _dual_clip(loss, adv, keep, dual_clip, sums)
    # the row's s_i (NaN from one token) stays off mask 0
    return torch.where(keep, loss, 0), sums


def _luspo(lp, lr, adv, rows, clip_low, clip_high) -> Out:
    loss, sums = _gspo(lp, lr, adv, rows, clip_low, clip_high)
    return loss * rows.per_token(rows.count), sums  # |y_i| × GSPO's term (whole rows' counts)


def _cispo(lp, lr, adv, rows, clip_low, clip_high, level) -> Out:
    keep = rows.keep
    sums: dict[str, tuple[torch.Tensor, str]] = {}
    if level == "sequence":
        (log_s,) = rows.means(lr)
        ratio = _exp(rows.per_token(log_s))
        sums["seq_ratio_mean"] = _seq_ratio_mean(log_s, rows)
    else:
        ratio = _exp(lr).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.where(keep, -weight * adv * lp, 0)
    return loss, {"pg_clipfrac": _hits(weight != ratio, keep), **sums}


def _sapo(lp, lr, adv, rows, tau_pos, tau_neg, level) -> Out:
    sums: dict[str, tuple[torch.Tensor, str]] = {}
    if level == "sequence":
        ratio, log_s = _seq_ratio(lp, lr, rows)
        sums["seq_ratio_mean"] = _seq_ratio_mean(log_s, rows)
    else:
        ratio = _exp(lr)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    return torch.where(rows.keep, -gate * adv, 0), sums


#: VESPO's floor of the sequence log-ratio, ``log(1e-8)`` (TRL, Liger)
VESPO_LOG_FLOOR = math.log(1e-8)


def _vespo(lp, lr, adv, rows, k_pos, lambda_pos, k_neg, lambda_neg) -> Out:
    keep = rows.keep
    (log_w,) = rows.sums(lr.clamp(-MAX_EXP_ARG, MAX_EXP_ARG))  # log W: the whole row's sum
    log_w = rows.per_token(log_w.clamp(VESPO_LOG_FLOOR, MAX_EXP_ARG))
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
    lam = torch.where(nonneg, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # φ(W) = W^k·e^(λ(1 − W))
    # an overflow of φ counts 0 (as TRL and Liger); a NaN stays NaN (a NaN log-ratio in the row)
    phi = torch.where(keep, torch.nan_to_num(phi, nan=math.nan, posinf=0.0), 0)
    return torch.where(keep, -phi * adv * lp, 0), {"vespo_phi_mean": (phi.sum(), "tokens")}


def _dppo(lp, lr, adv, rows, clip_low, clip_high, clip_ratio_c, divergence) -> Out:
    keep = rows.keep
    lp_d, lr_d = lp.detach(), lr.detach()
    ratio = _exp(lr_d)
    if divergence == "tv":  # π − π_old = −π·expm1(−lr): no cancellation
        diff = -torch.exp(lp_d) * torch.expm1(-lr_d)
        valid = torch.where(adv > 0, diff <= clip_high, diff >= -clip_low)
    else:  # Bernoulli KL(π_old || π) of the sampled token's probability
        lq = lp_d - lr_d  # log π_old
        q = torch.exp(lq)
        log_1mq = torch.log(-torch.expm1(lq))
        log_1mp = torch.log(-torch.expm1(lp_d))
        rest = torch.where(q < 1, -torch.expm1(lq) * (log_1mq - log_1mp), 0)
        kl = -q * lr_d + rest
        valid = torch.where(
            adv > 0, (kl <= clip_high) | (lr_d <= 0), (kl <= clip_low) | (lr_d >= 0)
        )
    weight = ratio.clamp_max(clip_ratio_c)
    loss = torch.where(keep & valid, -adv * weight * lp, 0)
    return loss, {
        "pg_clipfrac": _hits(~valid, keep),
        "pg_clipfrac_lower": _hits(valid & (ratio > clip_ratio_c), keep),
    }


def _dppo_tv(lp, lr, adv, rows, clip_low, clip_high, clip_ratio_c) -> Out:
    return _dppo(lp, lr, adv, rows, clip_low, clip_high, clip_ratio_c, "tv")


def _dppo_kl(lp, lr, adv, rows, clip_low, clip_high, clip_ratio_c) -> Out:
    return _dppo(lp, lr, adv, rows, clip_low, clip_high, clip_ratio_c, "kl")


def _dro(lp, lr, adv, rows, dro_beta) -> Out:
    return -adv * lp + (0.5 * dro_beta) * lr * lr, {}


def _ipo(lp, lr, adv, rows, ipo_threshold, adv_tau, kl_tau) -> Out:
    keep = rows.keep
    # |π − π_old| with π − π_old = −π·expm1(−lr) (no cancellation), read detached
    moved = (torch.exp(lp.detach()) * torch.expm1(-lr.detach())).abs() > ipo_threshold
    loss = torch.where(moved, 0, -adv_tau * adv * _exp(lr)) + kl_tau * lr * lr
    return loss, {"pg_clipfrac": _hits(moved, keep)}


def _topr(lp, lr, adv, rows, positive_weight, negative_weight) -> Out:
    taper = _exp(lr).detach().clamp_max(1.0)  # sg(clip(r, 0, 1))
    nonneg = adv >= 0
    weight = torch.where(nonneg, positive_weight, negative_weight * taper)
    # pg_clipfrac: where the taper binds, r > 1 with A < 0
    return -weight * adv * lp, {"pg_clipfrac": _hits(~nonneg & (lr > 0), rows.keep)}


def _clip_cov(
    lp, lr, adv, rows, clip_low, clip_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator
) -> Out:
    keep = rows.keep
    loss, hit = _clip_max(_exp(lr), adv, clip_low, clip_high)
    cov = _centred_cov(lp, adv, keep)
    cand = keep & ~hit & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    # A uniformly random subset of min(quota, #candidates) candidates: the candidates with the
    # smallest of iid uniform keys (the others are keyed 2, after every candidate).
    draw = {"generator": generator} if generator is not None else {}  # (traceable at any T)
    keys = torch.rand(keep.shape, dtype=torch.float64, device=keep.device, **draw)
    chosen = cand & (_rank(torch.where(cand, keys, 2.0)) < _quota(clip_cov_ratio, keep))
    loss = torch.where(chosen, 0, loss)
    return loss, {"pg_clipfrac": _hits(hit, keep), "clip_cov_frac": _hits(chosen, keep)}


def _kl_cov(lp, lr, adv, rows, kl_cov_ratio, ppo_kl_coef) -> Out:
    keep = rows.keep
    cov = _centred_cov(lp, adv, keep)
    # The quota of action tokens with the largest covariance (ties: the earlier token).
    keys = torch.where(keep, -cov, math.inf)
    chosen = keep & (_rank(keys) < _quota(kl_cov_ratio, keep))
    loss = -adv * _exp(lr) + torch.where(chosen, ppo_kl_coef * lr.abs(), 0)
    return loss, {
        "kl_cov_frac": _hits(chosen, keep),
        "ppo_kl_abs": (lr.detach().abs().sum(), "tokens"),
    }


def _geo_mean(lp, lr, adv, rows, clip_low, clip_high) -> Out:
    keep = rows.keep
    sign = torch.sign(adv)
    lr_clamped = lr.clamp(-clip_low, clip_high)
    # Pessimistic clip in log space: min for A > 0, max for A < 0, 0 where A == 0 (as GMPO).
    lr_clip = sign * torch.minimum(sign * lr, sign * lr_clamped)
    (log_r,) = rows.means(lr_clip)  # log of the whole row's geometric-mean ratio, [B, K]
    ratio = _exp(rows.per_token(log_r) + (lr_clip - lr_clip.detach()))
    out = lr != lr_clamped
    loss = torch.where(keep, -adv * ratio, 0)  # the row's R_i (NaN from one token) stays off mask 0
    return loss, {
        "pg_clipfrac": _hits(out & (adv > 0), keep),
        "pg_clipfrac_lower": _hits(out & (adv < 0), keep),
    }


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
    "luspo": _luspo,
    "vespo": _vespo,
    "dppo_tv": _dppo_tv,
    "dppo_kl": _dppo_kl,
    "dro": _dro,
    "ipo": _ipo,
    "topr": _topr,
}


POLICY_KINDS = tuple(_KINDS)
#: kinds whose per-token loss depends on a selection among all tokens of the call (clip_cov's
#: random subset, kl_cov's top covariances): not exact when rows are split over ranks
CP_INEXACT = ("clip_cov", "kl_cov")


def token_losses(kind: str, lp, lr, adv, rows, options: dict) -> Out:
    """The per-token loss of ``kind`` and its metric sums (checked ``options``)."""
    return _KINDS[kind](lp, lr, adv, rows, **options)
