"""One policy-loss API: a per-token loss matrix per kind, then one aggregation."""

from __future__ import annotations

import math

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import (
    as_bool_mask,
    check_2d,
    check_choice,
    check_same_shape,
    compute_dtype,
)
from rlops.distributed.collectives import fails_together
from rlops.losses._checks import check_options
from rlops.losses._common import constant
from rlops.losses.aggregation import AGGREGATION_KEYS, Aggregation, AggregationOptions
from rlops.losses.kinds import CP_INEXACT, POLICY_KINDS, token_losses

__all__ = ["POLICY_KINDS", "PolicyLossOptions", "policy_loss", "row_geometric_mean"]


class PolicyLossOptions(AggregationOptions, total=False):
    """The keywords of :func:`policy_loss`: the aggregation's and the kinds' options (numbers,
    numpy scalars or 0-dim tensors; per kind, with defaults: docs/design/losses.md)."""

    clip_low: float | torch.Tensor
    clip_high: float | torch.Tensor | None
    dual_clip: float | torch.Tensor | None
    clip_ratio_c: float | torch.Tensor
    level: str
    tau_pos: float | torch.Tensor
    tau_neg: float | torch.Tensor
    clip_cov_ratio: float | torch.Tensor
    clip_cov_lb: float | torch.Tensor
    clip_cov_ub: float | torch.Tensor
    generator: torch.Generator | None
    kl_cov_ratio: float | torch.Tensor
    ppo_kl_coef: float | torch.Tensor
    k_pos: float | torch.Tensor
    k_neg: float | torch.Tensor
    lambda_pos: float | torch.Tensor
    lambda_neg: float | torch.Tensor
    dro_beta: float | torch.Tensor
    ipo_threshold: float | torch.Tensor
    adv_tau: float | torch.Tensor
    kl_tau: float | torch.Tensor
    positive_weight: float | torch.Tensor
    negative_weight: float | torch.Tensor


@fails_together()
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "ppo",
    rollout_is_weights: torch.Tensor | None = None,
    agg: str | None = "token-mean",
    **options: Unpack[PolicyLossOptions],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss of one of :data:`POLICY_KINDS`: a per-token loss ``ℓ [B, T]``, times
    ``rollout_is_weights``, then ``aggregate_loss(ℓ, mask, agg)``.

    ``lr = logp − old_logp``, ``r = exp(min(lr, 20))``, ``A`` the advantage, ``sg`` stop-gradient,
    ``s_i = exp(mean_i lr)`` over row i's action tokens, ``s_t = sg(s_i)·π_t/sg(π_t)``; per token
    (arXiv ids; kinds' options and details: docs/design/losses.md)::

        ppo        max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)) ≤ −A·dual_clip  1707.06347
        reinforce  −A·log π  (gpg: the same loss)                             2504.02546
        gspo       ppo's max (and dual clip) with s_t for r                   2507.18071
        cispo      −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π          2506.13585
        sapo       −A·σ(τ·(r − 1))·4/τ, τ = tau_pos (A > 0) or tau_neg        2511.20347
        luspo      |y_i|·(gspo's ℓ), |y_i| the row's action count             2602.05261
        vespo      −sg(W^k·e^(λ(1 − W)))·A·log π, W = exp(Σ_i lr)             2602.10693
        dppo_tv    −A·sg(min(r, clip_ratio_c))·log π in the trust region      2602.04879
        dppo_kl    dppo_tv with the Bernoulli KL(π_old‖π) as the divergence
        dro        −A·log π + ½·dro_beta·lr²                                  2405.19107
        ipo        −adv_tau·A·r·[|π − π_old| ≤ ipo_threshold] + kl_tau·lr²    prime-rl
        topr       −w₊·A·log π (A ≥ 0), −w₋·sg(clip(r, 0, 1))·A·log π (A < 0)  2503.14286
        clip_cov   ppo, 0 on a random share of unclipped high-cov tokens      2505.22617
        kl_cov     −A·r, + ppo_kl_coef·|lr| on the tokens of largest cov      2505.22617
        geo_mean   −A·sg(R_i)·exp(l − sg l), R_i = exp(mean_i l), l clipped   2507.20673

    ipo: prime-rl's ``ipo_loss_fn`` (https://github.com/PrimeIntellect-ai/prime-rl), π and
    π_old the probabilities, ``pg_clipfrac`` the share of dropped tokens. topr: w₊, w₋ are
    ``positive_weight``, ``negative_weight``; it splits by the sign of A, ROLL by the row's
    score (the same with binary scores and a group baseline); ROLL's older form, with the
    positive and the negative rows averaged separately, is two calls, each with its rows in
    ``mask`` (docs/design/losses.md shows both).

    Args:
        logp: ``[B, T]`` log-probs under the policy being trained.
        old_logp, advantages: ``[B, T]``, constants (detached inside).
        mask: ``[B, T]`` 0/1 action mask.
        kind: one of :data:`POLICY_KINDS`.
        rollout_is_weights: ``None`` or a ``[B, T]`` multiplier of ``ℓ`` (a constant).
        agg: see :func:`aggregate_loss`; ``None`` returns ``ℓ`` (0 on mask-0 tokens).
        **options: :class:`PolicyLossOptions`; another keyword is a ``TypeError``.

    Returns:
        ``(loss, metrics)``: 0-dim loss and detached metrics (``pg_clipfrac``, ``ppo_kl``, ...).

    Example:
        >>> import torch
        >>> logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> loss, m = policy_loss(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
        >>> round(loss.item(), 4), round(m["pg_clipfrac"].item(), 4)
        (-0.4667, 0.6667)
    """
    check_2d("logp", logp)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages)
    keep = as_bool_mask("mask", mask, logp.shape, "logp", logp)
    check_choice("kind", kind, POLICY_KINDS)
    given = {k: v for k, v in options.items() if k not in AGGREGATION_KEYS}
    kind_options = check_options(kind, given)
    if rollout_is_weights is not None:
        check_same_shape("logp", logp, rollout_is_weights=rollout_is_weights)
    aggregated = {k: v for k, v in options.items() if k in AGGREGATION_KEYS}
    aggregation = Aggregation.checked("policy_loss", keep, logp, agg, aggregated)
    rows, dtype = aggregation.rows, aggregation.dtype
    if rows.cp and kind in CP_INEXACT:
        raise ValueError(
            f"policy_loss(kind={kind!r}) cannot be exact with cp_group: it selects among all "
            "the action tokens of the call (verl: per micro-batch), which no shard holds; use "
            "another kind, or compute it on whole rows"
        )
    # The sampling policy, the advantages and the weights are constants: no gradient into them.
    old_logp, advantages = constant(old_logp), constant(advantages)
    rollout_is_weights = constant(rollout_is_weights)
    # a rank's generator is its own: every other option must agree across the group
    shown = tuple((k, v) for k, v in kind_options.items() if k != "generator")
    call = aggregation.describe(
        "policy_loss",
        kind=kind,
        options=shown,
        rollout_is_weights=rollout_is_weights is not None,
        implied={"kind": ("options",)},
    )

    # Mask-0 entries are replaced before any arithmetic, so their gradient is exactly 0.
    lp = torch.where(keep, logp.to(dtype), 0)
    log_ratio = torch.where(keep, logp.to(dtype) - old_logp.to(dtype), 0)
    adv = torch.where(keep, advantages.to(dtype), 0)
    loss_mat, sums = token_losses(kind, lp, log_ratio, adv, rows, kind_options)
    none = (torch.zeros((), dtype=torch.int64, device=logp.device), "tokens")
    sums = {
        "pg_clipfrac": sums.pop("pg_clipfrac", none),
        "ppo_kl": ((-log_ratio.detach()).sum(), "tokens"),
        "pg_clipfrac_lower": sums.pop("pg_clipfrac_lower", none),
        **sums,
    }
    weights = None
    if rollout_is_weights is not None:
        weights = torch.where(keep, rollout_is_weights.to(dtype), 0)
        loss_mat = loss_mat * weights
    loss_mat = _keep_nan(loss_mat, lp, log_ratio, adv, weights)
    return aggregation.reduce(loss_mat, call, sums)


def _keep_nan(
    loss_mat: torch.Tensor,
    lp: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``loss_mat`` with NaN (value and gradient into ``logp``) on every action token where an
    input is NaN, whatever the kind did with it; elsewhere an exact 0 is added."""
    bad = log_ratio.isnan() | adv.isnan()
    if weights is not None:
        bad = bad | weights.isnan()
    # NaN · logp where bad, 0 · 0 elsewhere: a -inf logp off the bad tokens stays out of it
    poison = torch.where(bad, math.nan, 0.0).to(loss_mat.dtype)
    return loss_mat + poison * torch.where(bad, lp, 0)


def row_geometric_mean(
    weights: torch.Tensor, keep: torch.Tensor, *, eps: float = 0.0
) -> torch.Tensor:
    """Per row, ``exp(Σ_t m·log(w + eps) / max(Σ_t m, 1))`` along the row: a row-level
    ``rollout_is_weights`` from per-token ones (verl's geo_mean reads them so, ``eps=1e-10``).

    Args:
        weights, keep: ``[B, T]`` non-negative weights (read detached) and bool action mask.
        eps: added to each weight before its logarithm.

    Returns:
        ``[B, T]`` detached, in ``weights``' dtype.

    Example:
        >>> import torch
        >>> row_geometric_mean(torch.tensor([[1.0, 4.0, 9.0]]), torch.tensor([[True, True, False]]))
        tensor([[2., 2., 2.]])
    """
    w = weights.detach().to(compute_dtype(weights.dtype))
    log_w = torch.where(keep, torch.log(torch.where(keep, w, 1) + eps), 0)
    row = log_w.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).to(w.dtype).clamp_min(1)
    return torch.exp(row).expand_as(weights).to(weights.dtype)
