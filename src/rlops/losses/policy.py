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
    """The keyword arguments of :func:`policy_loss` beside ``kind``, ``rollout_is_weights`` and
    ``agg``: the aggregation's (:class:`rlops.losses.AggregationOptions`) and
    the kinds' options, each a number, a numpy scalar or a 0-dim tensor (which kind takes
    which, with its default and range: :func:`policy_loss`)."""

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

    Notation: ``lr = log π − log π_old`` (``logp − old_logp``), ``r = exp(min(lr, 20))``,
    ``A`` the advantage, ``sg`` stop-gradient, ``mean_i`` the mean over row i's action tokens
    (mask 1: tool and observation tokens of a multi-turn mask are left out). Per token::

        ppo       max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)); with dual_clip = c > 1,
                  min(that, −A·c) where A < 0
                  PPO https://arxiv.org/abs/1707.06347, dual-clip https://arxiv.org/abs/1912.09729,
                  clip-higher https://arxiv.org/abs/2503.14476
        reinforce −A·log π        (no ratio; "gpg" is the same loss, https://arxiv.org/abs/2504.02546)
        gspo      PPO's max with the ratio s_t = sg(s_i)·π_t/sg(π_t), s_i = exp(mean_i lr):
                  value the sequence ratio s_i, gradient s_i·∇log π_t ("GSPO-token"; with one
                  advantage per row and seq-mean-token-mean it is GSPO's sequence objective)
                  https://arxiv.org/abs/2507.18071 (defaults clip_low 3e-4, clip_high 4e-4);
                  with dual_clip = c > 1, min(that, −A·c) where A < 0 (verl's clip_ratio_c,
                  AReaL's c_clip with importance_sampling_level="sequence")
        cispo     −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π
                  MiniMax-M1, https://arxiv.org/abs/2506.13585 (the paper sets no lower clip:
                  clip_low=inf); level="sequence": r is the row's s_i (TRL's
                  importance_sampling_level="sequence": −sg(clip(s_i))·A·log π_t)
        sapo      −A·σ(τ·(r − 1))·4/τ, τ = tau_pos where A > 0 else tau_neg (defaults 1.0, 1.05):
                  a soft gate whose gradient at r = 1 equals PPO's
                  https://arxiv.org/abs/2511.20347; level="sequence": r is gspo's s_t (value
                  s_i, gradient s_i·∇log π_t), as TRL's and AReaL's
                  importance_sampling_level="sequence" with one advantage per row
        luspo     |y_i|·(gspo's per-token loss), |y_i| the row's action count: with
                  agg="seq-mean-token-mean" it is LUSPO's −mean_i |y_i|·min(s_i·A_i,
                  clip(s_i)·A_i) (the same as kind="gspo" with agg="seq-mean-token-sum")
                  https://arxiv.org/abs/2602.05261; TRL's and Liger's loss_type="luspo"
                  (defaults clip_low 2e-3, clip_high 2.5e-3, the paper's section 5.1)
        vespo     −sg(φ(W_i))·A·log π, φ(W) = W^k·exp(λ·(1 − W)) with W_i = exp(Σ_i lr) the
                  row's sequence ratio (each lr clamped to ±20, log W_i to [log 1e-8, 20];
                  a φ that overflows counts 0, as TRL's and Liger's nan_to_num; a NaN stays);
                  k, λ = k_pos, lambda_pos where A ≥ 0 else k_neg, lambda_neg (defaults 2, 3,
                  3, 2) https://arxiv.org/abs/2602.10693; TRL's and Liger's loss_type="vespo"
                  (they fold the sampler's token IS ratios into W: pass the sampler's
                  log-probs as old_logp for that)
        dppo_tv   −A·sg(min(r, clip_ratio_c))·log π on the tokens whose probability moved
                  inside the trust region: π − π_old ≤ clip_high where A > 0, ≥ −clip_low
                  where A ≤ 0; 0 elsewhere
        dppo_kl   the same with the Bernoulli KL D = π_old·log(π_old/π) + (1 − π_old)·
                  log((1 − π_old)/(1 − π)): a token stays where D ≤ clip_high or π ≤ π_old
                  (A > 0), D ≤ clip_low or π ≥ π_old (A ≤ 0). DPPO
                  https://arxiv.org/abs/2602.04879, as verl's dppo_tv / dppo_kl (defaults
                  clip_low = clip_high = 0.2, clip_ratio_c = 20)
        dro       −A·log π + ½·dro_beta·lr²: the quadratic log-ratio penalty of Direct Reward
                  Optimization https://arxiv.org/abs/2405.19107, as Tinker's "dro" loss
                  (default dro_beta 1)
        clip_cov  ppo (no dual clip), but 0 on a random set of tokens not clipped by PPO whose
                  cov = (A − mean A)·(log π − mean log π) (means over the micro-batch's action
                  tokens) lies in (clip_cov_lb, clip_cov_ub): max(⌊clip_cov_ratio·N⌋, 1) of them
                  (fewer if fewer qualify), drawn with the generator option (on logp's device)
        kl_cov    −A·r, plus ppo_kl_coef·|lr| on the max(⌊kl_cov_ratio·N⌋, 1) action tokens of
                  largest cov. clip_cov and kl_cov: https://arxiv.org/abs/2505.22617
        geo_mean  −A·R_t, R_t = sg(R_i)·exp(l_t − sg(l_t)), R_i = exp(mean_i l) with l_t the
                  log-ratio clipped pessimistically in log space (min(lr, clip_high) where A > 0,
                  max(lr, −clip_low) where A < 0, 0 where A = 0): the geometric mean of the
                  row's clipped ratios. With one advantage per row and seq-mean-token-mean this
                  is GMPO's −A_i·R_i exactly https://arxiv.org/abs/2507.20673 (defaults
                  clip_low = clip_high = 0.4, in log space: ratios in (e^−0.4, e^0.4))

    Sequence-level quantities (s_i, R_i, W_i, |y_i|) are over the row's action tokens only,
    from summed log-ratios (a 32K-token row is fine); every ``exp`` argument is clamped to
    ``≤ 20``. The selections of clip_cov and kl_cov use this call's tokens (as verl: per
    micro-batch); they read no value on the host. ``clip_high`` defaults to ``clip_low`` when
    only ``clip_low`` is given; an infinite clip turns that side off.

    Recipes (compositions of the kinds above, not kinds): verl's **bypass mode** (the sampler's
    log-probs stand for π_old) is ``old_logp = rollout_logp`` with kind="ppo" and no weights
    (``loss_type="ppo_clip"``), or kind="reinforce" with ``rollout_is_weights`` from
    :func:`rlops.rollout_importance_weights` of ``(logp.detach(), rollout_logp)`` and its
    rejection mask folded into ``mask`` (``loss_type="reinforce"``); the adapter is
    ``rlops.compat.verl.get_policy_loss_fn("bypass_mode")``.

    ``old_logp``, ``advantages`` and ``rollout_is_weights`` stand for a fixed policy and fixed
    targets: they are detached inside, so the gradient flows into ``logp`` only.

    **NaN.** A NaN in ``logp``, ``old_logp``, ``advantages`` or ``rollout_is_weights`` at an
    action token makes that token's loss NaN, and its gradient into ``logp`` NaN, whatever the
    kind does with the token (dppo's trust region would drop it, vespo's φ or a clip would map
    it to a number; reinforce and gpg, which do not read ``old_logp``, are no exception): the
    loss is NaN, never a finite number that hides it. A NaN at a mask-0 token is never read.

    **Context parallelism** (``cp_group=``: each row split over the ranks of ``cp_group``,
    ``cp_layout`` zigzag or contiguous — sums need no order). The ranks' losses **sum** to the
    loss of the whole rows and each rank's gradient is the whole rows' gradient on its tokens:
    s_i and R_i are formed from each rank's partial row sums of log-ratios by one collective of
    ``[B, 2]`` row summaries (count, sum) over ``cp_group`` (nothing of size ``T`` crosses
    ranks), the aggregation divides by the whole rows' counts (see :func:`aggregate_loss`) and
    the metrics are the whole rows'. Collectives per call: one over ``cp_group`` for ppo,
    reinforce, gpg, cispo and sapo; two for gspo and geo_mean (the row summaries, then the
    metrics); with ``group=`` (then the DP×CP group) the row summaries over ``cp_group`` and
    one over ``group``. luspo, vespo and cispo / sapo with level="sequence" count as gspo
    (a per-row ratio); dppo_tv, dppo_kl and dro as ppo. clip_cov and kl_cov select among all
    the tokens of the call, which a shard does not hold: with ``cp_group`` (of more than one
    rank) they raise ``ValueError``.
    **Packed rows** (``seq_ids``, ``seqs_per_row``): s_i, R_i, W_i, |y_i| and the seq-mean
    modes are per sequence.
    ``rollout_is_weights`` (``[B, T]``) multiplies ``ℓ`` before aggregation: pass
    truncated token-level IS weights, or a sequence-level weight repeated along its row.

    Differences from verl's registered losses: every kind aggregates with ``agg`` (verl forces
    seq-mean-token-mean for gspo and sapo and a plain mean over all rows for geo_mean: pass
    ``agg="seq-mean-token-mean"`` for those); gspo's log-ratio is clamped at 20 (verl: 10);
    geo_mean multiplies per-token weights (verl: their geometric mean per row); verl's
    ``pg_clipfrac`` of clip_cov is the selected share (here ``clip_cov_frac``) and its
    ``ppo_kl`` of kl_cov is the mean |lr| (here ``ppo_kl_abs``).

    Args:
        logp: ``[B, T]`` log-probs under the policy being trained (carries the gradient).
        old_logp: ``[B, T]`` log-probs under the policy that sampled the tokens; a constant
            (detached inside: ``old_logp=logp`` gives the gradient of ``old_logp=logp.detach()``,
            ratio 1).
        advantages: ``[B, T]``; a constant (detached inside).
        mask: ``[B, T]`` 0/1 action mask.
        kind: one of :data:`POLICY_KINDS`.
        rollout_is_weights: ``None`` or a floating ``[B, T]`` multiplier; a constant
            (detached inside).
        agg: aggregation mode, see :func:`aggregate_loss`; ``None`` returns the per-token loss
            matrix ``[B, T]`` (0 on mask-0 tokens).
        **options: the aggregation's normalisers, groups and packing
            (:class:`rlops.losses.AggregationOptions`, as
            :func:`aggregate_loss`; ``cp_group`` as above): with ``num_tokens``,
            ``num_seqs`` or ``group`` the micro-batch losses *sum* to the full-batch loss.
            And the kind's options (numbers, numpy scalars or 0-dim tensors;
            :class:`PolicyLossOptions`):
            ppo: ``clip_low`` (in (0, 1) or inf; 0.2), ``clip_high`` (> 0), ``dual_clip``
            (None or > 1); gspo, cispo: ``clip_low``, ``clip_high``; sapo: ``tau_pos``,
            ``tau_neg`` (> 0); clip_cov: ``clip_low``, ``clip_high``, ``clip_cov_ratio``
            (in (0, 1]; 2e-4), ``clip_cov_lb`` < ``clip_cov_ub`` (1, 5), ``generator``;
            kl_cov: ``kl_cov_ratio`` (2e-4), ``ppo_kl_coef`` (≥ 0; 1); geo_mean: ``clip_low``,
            ``clip_high`` (> 0, log space); gspo also ``dual_clip``; cispo and sapo also
            ``level`` ("token" or "sequence"); luspo: ``clip_low``, ``clip_high``; vespo:
            ``k_pos``, ``k_neg`` (finite), ``lambda_pos``, ``lambda_neg`` (> 0); dppo_tv,
            dppo_kl: ``clip_low``, ``clip_high`` (divergence bounds > 0), ``clip_ratio_c``
            (> 0); dro: ``dro_beta`` (≥ 0). Another option is a ``TypeError``.

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32 for half inputs; ``[B, T]`` with
        ``agg=None``) and detached 0-dim metrics over this call's action tokens — over the
        whole rows' with ``cp_group``, over the whole group's with ``group=``, in the same
        ``all_gather`` as the normaliser —
        before the weights (verl's names): ``pg_clipfrac`` (fraction where the clip binds: ppo,
        gspo, luspo, clip_cov: the clipped term is the larger; cispo: the weight is clipped;
        dppo_*: the token is outside the trust region (dropped); geo_mean:
        the log-ratio lies outside the range where A > 0), ``pg_clipfrac_lower`` (ppo, gspo: where
        dual-clip binds; geo_mean: outside the range where A < 0; dppo_*: where
        ``r > clip_ratio_c`` on a kept token), ``ppo_kl`` (mean of
        ``old_logp − logp``, unclamped) — 0 where a kind has no such thing — and per kind:
        gspo, luspo and level="sequence" ``seq_ratio_mean`` (mean s_i over rows with an
        action), vespo ``vespo_phi_mean`` (mean φ over the action tokens), clip_cov
        ``clip_cov_frac``, kl_cov ``kl_cov_frac`` and ``ppo_kl_abs`` (mean |lr|).

    Example:
        >>> import torch
        >>> logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> loss, m = policy_loss(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
        >>> round(loss.item(), 4), round(m["pg_clipfrac"].item(), 4)
        (-0.4667, 0.6667)
        >>> loss, m = policy_loss(logp, old, torch.ones(1, 3), torch.ones(1, 3), kind="gspo")
        >>> round(loss.item(), 4), round(m["seq_ratio_mean"].item(), 4)
        (-0.8465, 0.8465)
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
    """``loss_mat`` with NaN, in value and in the gradient into ``logp``, on every action token
    where an input is NaN (``logp``, ``old_logp`` — both in the log-ratio —, the advantage or
    the weight), whatever the kind does with the token: a kind that drops it (dppo's trust
    region compares, and a comparison with NaN is False), clamps it or maps it to a number
    must not turn it into a finite loss. The inputs are 0 on mask-0 tokens, so those stay as
    they are; on the other tokens the term is an exact 0 with a zero gradient."""
    bad = log_ratio.isnan() | adv.isnan()
    if weights is not None:
        bad = bad | weights.isnan()
    # NaN · logp where bad, 0 · 0 elsewhere: a -inf logp off the bad tokens stays out of it
    poison = torch.where(bad, math.nan, 0.0).to(loss_mat.dtype)
    return loss_mat + poison * torch.where(bad, lp, 0)


def row_geometric_mean(
    weights: torch.Tensor, keep: torch.Tensor, *, eps: float = 0.0
) -> torch.Tensor:
    """Per row, the geometric mean of ``weights + eps`` over the row's action tokens, repeated
    along the row: ``exp(Σ_t m·log(w + eps) / max(Σ_t m, 1))`` (1 for a row with no action
    token). A row-level ``rollout_is_weights`` for :func:`policy_loss` made from per-token
    weights (verl's geo_mean loss reads them so, with ``eps = 1e-10``).

    Args:
        weights: ``[B, T]`` non-negative floating weights, read detached (checked by the
            caller, as ``policy_loss`` checks ``rollout_is_weights``).
        keep: ``[B, T]`` bool action mask; entries off it are never read.
        eps: added to every weight before its logarithm (``0``: a zero weight makes its row 0).

    Returns:
        ``[B, T]`` detached, in ``weights``' dtype (computed in float32 for half weights).

    Example:
        >>> import torch
        >>> keep = torch.tensor([[True, True, False]])
        >>> row_geometric_mean(torch.tensor([[1.0, 4.0, 9.0]]), keep)
        tensor([[2., 2., 2.]])
    """
    w = weights.detach().to(compute_dtype(weights.dtype))
    log_w = torch.where(keep, torch.log(torch.where(keep, w, 1) + eps), 0)
    row = log_w.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).to(w.dtype).clamp_min(1)
    return torch.exp(row).expand_as(weights).to(weights.dtype)
