"""Drop-in replacements for verl's advantage estimators, losses and torch utilities, on rlops.

Names, arguments and return tuples follow verl's ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py`` (signatures as of verl's main branch in August 2026:
estimators return ``(advantages, returns)``; ``agg_loss`` and ``compute_value_loss`` take
``dp_size``, ``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor``; the
registered ``"vanilla"`` loss returns ``(loss, metrics)``, the deprecated
``compute_policy_loss`` ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``); the registered
losses ``gspo``, ``sapo``, ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov`` and ``geo_mean`` in
:data:`POLICY_LOSS_REGISTRY` / :func:`get_policy_loss_fn`; and the rollout correction of
``verl/trainer/ppo/rollout_corr_helper.py`` with its string options and its diagnostics
``compute_is_metrics`` / ``compute_rs_metrics``; the OPO, GPG, GRPO pass@k, GDPO and
optimal-token-baseline estimators (OTB and its multi-turn TIR form, which take the per-token
Σπ² of the log-prob ops). Tensors are ``[bs,
response_length]`` with a 0/1 ``response_mask``; every adapter is one or two rlops calls, with
no Python loop over tokens, samples or groups (verl's GAE and REINFORCE++ loop over tokens, its
GRPO and RLOO over samples and groups). Arguments are checked first and errors name verl's
arguments; scalars may be numbers, numpy scalars or 0-dim tensors.

Deliberate differences, detailed in each docstring: tokens with ``response_mask = 0`` get 0 in
every output (verl leaves whitened or carried values there; no loss reads them); the estimators
that whiten (GAE, REINFORCE++, REINFORCE++-baseline) give 0 where a single or no token is
selected, where verl's ``masked_whiten`` raises ``ValueError`` (:func:`masked_whiten` itself
raises as verl); bfloat16 log-probs and entropies come back in float32. REINFORCE++ skips mask-0
tokens (tool output), carrying the return across them, as verl does since its PR #7300
(August 2026; versions before reset the return at every mask-0 token).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_int,
    check_2d,
    check_choice,
    check_count,
    check_nonneg,
    check_positive,
    check_same_shape,
    check_unit_interval,
    shape_error,
)
from rlops.compat._verl_estimators import (
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    group_ids,
    outcome_inputs,
)
from rlops.compat._verl_kinds import batch_info, config_value, kind_loss
from rlops.compat._verl_metrics import compute_is_metrics, compute_rs_metrics
from rlops.compat._verl_rollout import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    correction_and_rejection,
)
from rlops.losses import AGG_MODES, KL_KINDS

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_is_metrics",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_offpolicy_metrics",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "compute_value_loss",
    "entropy_from_logits",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_whiten",
]


def _response_mask(response_mask: object, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """verl's ``response_mask``: a 0/1 tensor of the shape of ``like``, as bool."""
    return as_bool_mask("response_mask", response_mask, like.shape, like_name, like)


# --------------------------------------------------------------------------- estimators
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma,
    lam,
):
    """GAE with observation tokens skipped, advantages whitened: ``(advantages, returns)``.

    On action tokens (mask 1): ``δ_t = r_t + γ·V_next − V_t`` and ``A_t = δ_t + γλ·A_next``,
    where "next" is the next action token (mask-0 tokens pass values and advantages through,
    as verl's multi-turn GAE); ``returns = A + V``; advantages are then whitened over the
    mask-1 tokens (:func:`masked_whiten`). One :func:`rlops.gae` call.

    Difference: on mask-0 tokens both outputs are 0 (verl leaves the carried advantage, whitened,
    and ``A + V`` there).

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> adv, ret = compute_gae_advantage_return(r, torch.zeros(2, 3), torch.ones(2, 3),
        ...                                         gamma=1.0, lam=1.0)
        >>> ret
        tensor([[1., 1., 1.],
                [1., 1., 0.]])
    """
    check_2d("token_level_rewards", token_level_rewards)
    check_same_shape("token_level_rewards", token_level_rewards, values=values)
    mask = _response_mask(response_mask, "token_level_rewards", token_level_rewards)
    gamma, lam = check_unit_interval("gamma", gamma), check_unit_interval("lam", lam)
    with torch.no_grad():
        adv, ret = rlops.gae(token_level_rewards, values, gamma=gamma, lam=lam, mask=mask)
        return rlops.masked_whiten(adv, mask), ret


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
):
    """GRPO (or Dr.GRPO with ``norm_adv_by_std_in_grpo=False``) outcome advantages.

    Score = sum of the row's token rewards, standardised within its group (``index``: one uid
    per row, any hashable values): ``(s − mean) / (std + epsilon)`` with the unbiased std; a
    group of one has mean 0 and std 1. Broadcast over the mask-1 tokens; returns
    ``(advantages, advantages)``. One :func:`rlops.grpo_advantages` call (no loop over samples
    or groups).

    Example:
        >>> import numpy as np, torch
        >>> adv, _ = compute_grpo_outcome_advantage(
        ...     torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2), np.array(["a", "a"]))
        >>> adv
        tensor([[ 0.7071,  0.7071],
                [-0.7071, -0.7071]])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    epsilon = check_nonneg("epsilon", epsilon)
    with torch.no_grad():
        ids = group_ids(index, token_level_rewards.device)
        return rlops.grpo_advantages(
            token_level_rewards, ids, mask, norm_std=norm_adv_by_std_in_grpo, eps=epsilon
        )


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
):
    """RLOO: each score minus the mean of the other scores of its group (a group of one keeps
    its score), broadcast over the mask-1 tokens; ``(advantages, advantages)``.

    Example:
        >>> import torch
        >>> adv, _ = compute_rloo_outcome_advantage(
        ...     torch.tensor([[1.0], [0.0], [2.0]]), torch.ones(3, 1), [0, 0, 0])
        >>> adv[:, 0]
        tensor([ 0.0000, -1.5000,  1.5000])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        ids = group_ids(index, token_level_rewards.device)
        return rlops.rloo_advantages(token_level_rewards, ids, mask)


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
):
    """REINFORCE++-baseline: score minus its group mean, broadcast, whitened over the mask-1
    tokens of the batch; ``(advantages, advantages)``. ``epsilon`` is unused, as in verl (the
    whitening adds 1e-8 to the variance).

    Example:
        >>> import torch
        >>> adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(
        ...     torch.tensor([[1.0], [0.0], [3.0], [1.0]]), torch.ones(4, 1), [0, 0, 1, 1])
        >>> adv[:, 0]
        tensor([ 0.5477, -0.5477,  1.0954, -1.0954])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        ids = group_ids(index, token_level_rewards.device)
        return rlops.reinforce_plus_plus_baseline_advantages(
            token_level_rewards, ids, mask, eps=1e-8
        )


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config=None, **kwargs
):
    """REINFORCE++: discounted returns over the action tokens, whitened; ``(advantages,
    returns)``. ``gamma`` is read from ``config`` (``config.gamma`` or ``config["gamma"]``).

    ``G_t = r_t + γ·G_next`` with "next" the next mask-1 token
    (:func:`rlops.discounted_returns` with ``mask``); advantages are ``G`` whitened over the
    mask-1 tokens.

    Mask-0 tokens (tool output in multi-turn rollouts) are skipped: the return is carried across
    them unchanged, so the outcome reaches every earlier action, discounted once per action
    step; their own rewards are ignored and returns and advantages are 0 there. verl does the
    same since its PR #7300 (August 2026, fixing verl issue #7278). verl versions before it
    reset the running return at every mask-0 token ("reset after EOS"), which drops the outcome
    for every action before a tool span; without interior mask-0 spans all agree.

    Difference: a single or no mask-1 token gives advantages 0 (verl's ``masked_whiten`` raises
    ``ValueError``).

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
        >>> m = torch.tensor([[1, 0, 0, 1]])  # two tool tokens between two actions
        >>> compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": 0.5})[1]
        tensor([[0.5000, 0.0000, 0.0000, 1.0000]])
    """
    gamma = config_value(config, "gamma")
    if gamma is None:
        raise ValueError("config must provide gamma (config.gamma or config['gamma'])")
    gamma = check_unit_interval("gamma", gamma)
    mask = outcome_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        returns = rlops.discounted_returns(token_level_rewards, gamma=gamma, mask=mask)
        return rlops.masked_whiten(returns, mask), returns


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config=None,
    **kwargs,
):
    """ReMax: undiscounted reward-to-go minus the greedy rollout's reward; ``(advantages,
    returns)``.

    Difference: 0 on mask-0 tokens (verl carries the reward-to-go there).

    Example:
        >>> import torch
        >>> adv, ret = compute_remax_outcome_advantage(
        ...     torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]), torch.ones(1, 2))
        >>> adv
        tensor([[0.7500, 0.7500]])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    b = token_level_rewards.shape[0]
    if not isinstance(reward_baselines, torch.Tensor):
        raise TypeError(
            f"reward_baselines must be a torch.Tensor, got {type(reward_baselines).__name__}"
        )
    if tuple(reward_baselines.shape) != (b,):
        raise shape_error("reward_baselines", f"[bs] = [{b}]", reward_baselines.shape)
    with torch.no_grad():
        return rlops.remax_advantages(token_level_rewards, reward_baselines, mask)


# --------------------------------------------------------------------------- KL and losses
def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty) -> torch.Tensor:
    """Per-token KL estimate: ``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``,
    ``"low_var_kl"``/``"k3"`` (clamped to [−10, 10], as verl: gradient 0 where clamped), and the
    straight-through ``"+"`` variants (value of the kind, gradient of k2). ``"full"`` raises
    ``NotImplementedError``. :func:`rlops.kl_penalty` without ``old_logp``: no importance
    correction, as verl.

    Example:
        >>> import torch
        >>> kl_penalty(torch.tensor([-1.0, -20.0]), torch.tensor([-1.5, -1.0]), "k3")
        tensor([ 0.1065, 10.0000])
    """
    kind = kl_penalty
    if kind == "full":
        raise NotImplementedError("kl_penalty 'full' needs the whole distribution")
    check_choice("kl_penalty", kind, KL_KINDS)
    check_same_shape("logprob", logprob, ref_logprob=ref_logprob)
    base = kind.rstrip("+")
    if base == "k3":  # verl's k3 is its low_var_kl (clamped at 10)
        kind = "low_var_kl" + kind[len(base) :]
    return rlops.kl_penalty(logprob, ref_logprob, kind)


def _global_count(name: str, value: object) -> float | torch.Tensor | None:
    """``batch_num_tokens`` / ``global_batch_size``: a number or a 0-dim tensor, kept as given
    (verl may pass a device tensor; it is not read back to the host)."""
    return check_count(name, value)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Aggregate a ``[bs, T]`` loss to a scalar with verl's ``loss_agg_mode`` names.

    ``token-mean`` = Σ m·ℓ / N, ``token-sum`` = Σ m·ℓ, ``seq-mean-token-sum`` =
    Σ_seq Σ_t m·ℓ / S, ``seq-mean-token-mean`` = Σ_seq mean_t / S, ``seq-mean-token-sum-norm``
    = the ``seq-mean-token-sum`` value divided by ``loss_scale_factor`` (default T). ``N`` is
    ``batch_num_tokens`` (default: this micro-batch's mask-1 tokens) and ``S`` is
    ``global_batch_size`` (default: its rows with a mask-1 token), each result multiplied by
    ``dp_size`` so that averaging over data-parallel ranks gives the global value, as in verl:
    :func:`rlops.aggregate_loss` with ``num_tokens``/``num_seqs``, times ``dp_size``.

    Difference: an empty batch gives 0 (verl: NaN, or 0 in newer versions).

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> agg_loss(loss, m, "token-mean"), agg_loss(loss, m, "seq-mean-token-mean")
        (tensor(2.5000), tensor(3.))
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("loss_mask", loss_mask, loss_mat.shape, "loss_mat", loss_mat)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    dp_size = as_int("dp_size", dp_size, minimum=1)
    if loss_scale_factor is not None:
        loss_scale_factor = check_positive("loss_scale_factor", loss_scale_factor)
    batch_num_tokens = _global_count("batch_num_tokens", batch_num_tokens)
    global_batch_size = _global_count("global_batch_size", global_batch_size)
    if dp_size > 1:  # as verl: the global count of the mode's normaliser must be given
        if loss_agg_mode == "token-mean" and batch_num_tokens is None:
            raise ValueError("batch_num_tokens is required when dp_size > 1")
        if loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
            raise ValueError("global_batch_size is required when dp_size > 1")
    share = rlops.aggregate_loss(
        loss_mat,
        keep,
        loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        num_tokens=batch_num_tokens,
        num_seqs=global_batch_size,
    )
    # rlops' shares sum to the global loss over ranks; verl's DDP/FSDP average over them
    return share * dp_size


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
    """verl's PPO arguments checked under verl's names (or its actor config's, ``names``);
    returns the per-token loss ``[bs, T]`` (0 on mask-0 tokens; times ``rollout_is_weights``),
    the metrics (before the weights) and the mask."""
    check_2d("old_log_prob", old_log_prob)
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    check_same_shape(
        "old_log_prob", old_log_prob, log_prob=log_prob, advantages=advantages, **weights
    )
    mask = _response_mask(response_mask, "old_log_prob", old_log_prob)
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
    """PPO clipped loss with dual-clip: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``
    (verl's deprecated free function; the registered loss is :func:`compute_policy_loss_vanilla`).

    ``ratio = exp(log_prob − old_log_prob)``; per token
    ``max(−A·ratio, −A·clip(ratio, 1 − low, 1 + high))``, bounded by ``−A·clip_ratio_c`` where
    ``A < 0``; aggregated with ``loss_agg_mode``. ``cliprange_low``/``cliprange_high`` default
    to ``cliprange``. :func:`rlops.policy_loss` per token, then :func:`agg_loss`; metrics are
    detached tensors.

    Differences: verl clamps the log-ratio to [−20, 20]; rlops clamps only its upper end (the
    ``exp`` side). Below −20 the ratio is ``e^{log-ratio}`` rather than ``e^{−20}`` (both
    ~1e-9), and ``ppo_kl`` is the mean of the unclamped ``old_log_prob − log_prob``. Clip
    ranges must be > 0 (verl accepts 0).

    Example:
        >>> import torch
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
    """verl's registered ``"vanilla"`` policy loss: ``(pg_loss, metrics)``.

    The loss of :func:`compute_policy_loss` with the clip ranges of the actor config
    (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` with default
    3.0); the per-token loss is multiplied by ``rollout_is_weights`` (rollout correction)
    before :func:`agg_loss`, which receives ``config.global_batch_info`` (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) as in verl. ``metrics``
    holds Python floats ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower``
    (computed before the weights), as verl's.

    Example:
        >>> import torch
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


# --------------------------------------------------------------------------- registered losses
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"gspo"`` loss: ``(pg_loss, metrics)``.

    GSPO-token: PPO's clipped max with the ratio ``s_t = sg(s_i)·π_t/sg(π_t)``,
    ``s_i = exp(mean_i(log π − log π_old))`` over the row's response tokens, clip ranges
    ``config.clip_ratio_low`` / ``clip_ratio_high`` (default ``clip_ratio``); aggregated with
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says, as verl. ``rlops.policy_loss(kind=
    "gspo")``. Metrics ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (0).

    Difference: the log-ratio is clamped at 20 before ``exp`` (verl: 10).

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_gspo(torch.zeros(1, 2), torch.zeros(1, 2),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> loss, m["actor/pg_clipfrac"]
        (tensor(-1.), 0.0)
    """
    return kind_loss(
        "gspo",
        agg_loss,
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
    """verl's registered ``"sapo"`` loss: ``(pg_loss, metrics)``.

    ``−A·σ(τ·(r − 1))·4/τ`` with ``τ = config.tau_pos`` where ``A > 0``, else ``config.tau_neg``
    (verl's defaults 1.0, 1.05 where absent); aggregated with ``seq-mean-token-mean`` whatever
    ``loss_agg_mode``
    says, as verl. Metrics ``actor/ppo_kl``; ``actor/pg_clipfrac`` and ``_lower`` are 0.

    Difference: the log-ratio is clamped only above (at 20; verl: to [−20, 20]).

    Example:
        >>> import torch
        >>> loss, _ = compute_policy_loss_sapo(torch.zeros(1, 1), torch.zeros(1, 1),
        ...     torch.ones(1, 1), torch.ones(1, 1), config={"tau_pos": 1.0, "tau_neg": 1.05})
        >>> loss
        tensor(-2.)
    """
    return kind_loss(
        "sapo",
        agg_loss,
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
    """verl's registered ``"gpg"`` loss: ``(pg_loss, {})``.

    ``−A·log π`` per token, aggregated with ``loss_agg_mode`` and ``config.global_batch_info``.

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_gpg(torch.zeros(1, 2), torch.tensor([[-1.0, -2.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> loss, m
        (tensor(1.5000), {})
    """
    return kind_loss(
        "gpg",
        agg_loss,
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
    """verl's registered ``"clip_cov"`` loss: ``(pg_loss,
    metrics)``.

    PPO's clipped loss (no dual clip), set to 0 on a random set of ``max(⌊clip_cov_ratio·N⌋,
    1)`` response tokens not clipped by PPO whose centred covariance of advantage and log-prob
    lies in ``(clip_cov_lb, clip_cov_ub)`` (``config.policy_loss``; defaults 2e-4, 1, 5).
    Metrics ``actor/pg_clipfrac`` (the share of tokens set to 0, as verl) and ``actor/ppo_kl``.

    Difference: the random subset is drawn differently (verl: ``torch.randperm`` of the
    candidates), so only its size and its candidates agree.

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_clip_cov(torch.zeros(1, 2), torch.zeros(1, 2),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> loss, m["actor/pg_clipfrac"]
        (tensor(-1.), 0.0)
    """
    return kind_loss(
        "clip_cov",
        agg_loss,
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
    """verl's registered ``"kl_cov"`` loss: ``(pg_loss, metrics)``.

    ``−A·r`` per token plus ``ppo_kl_coef·|log r|`` on the ``max(⌊kl_cov_ratio·N⌋, 1)`` response
    tokens of largest centred covariance (``config.policy_loss``; verl's fallbacks 2e-4 and 1.0
    when unset). Metric ``actor/ppo_kl``: the mean ``|log r|``, as verl.

    Difference: ties in the covariance go to the earlier token (``torch.topk`` leaves them
    unspecified).

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_kl_cov(torch.zeros(1, 2), torch.tensor([[0.5, 0.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"policy_loss": {"ppo_kl_coef": 1.0}})
        >>> round(m["actor/ppo_kl"], 4)
        0.25
    """
    return kind_loss(
        "kl_cov",
        agg_loss,
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
    """verl's registered ``"geo_mean"`` loss (GMPO):
    ``(pg_loss, metrics)``.

    ``−Ā_i·R_i`` per row, ``R_i`` the geometric mean of the row's ratios clipped
    pessimistically in log space to ``(−clip_ratio_low, clip_ratio_high)``, averaged over all
    rows (``loss_agg_mode`` and ``global_batch_info`` are ignored, as verl); per-token
    ``rollout_is_weights`` are reduced to their geometric mean per row first, as verl. Metrics
    ``actor/pg_clipfrac`` (out of range where A > 0), ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` (where A < 0).

    Difference: the value is verl's; the gradient is verl's when each row has one advantage (as
    verl requires); with per-token advantages it is ``mean_t(−A_t·R_i·∇l_t)`` (verl:
    ``−Ā_i·R_i·mean_t ∇l_t``).

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_geo_mean(torch.zeros(1, 2), torch.tensor([[0.2, 0.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.4})
        >>> round(loss.item(), 4)
        -1.1052
    """
    return kind_loss(
        "geo_mean",
        agg_loss,
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
    """verl's registered ``"cispo"`` loss: ``(pg_loss, metrics)``.

    ``−sg(clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high))·A·log π`` per token, aggregated with
    ``loss_agg_mode``. Metrics ``actor/pg_clipfrac`` (the weight is clipped), ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` (0).

    Difference: the log-ratio is clamped only above (at 20; verl: to [−20, 20]).

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_cispo(torch.zeros(1, 2), torch.tensor([[0.5, -1.0]]),
        ...     torch.ones(1, 2), torch.ones(1, 2), config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), m["actor/pg_clipfrac"]
        (0.1, 1.0)
    """
    return kind_loss(
        "cispo",
        agg_loss,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


#: verl's registered policy-loss names -> adapters (``dppo_tv``, ``dppo_kl`` and
#: ``bypass_mode`` are added at the end of this module).
POLICY_LOSS_REGISTRY = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
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


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """Clipped value loss ``0.5·agg(max((V − R)², (clip(V, V_old ± c) − R)²))`` and the
    fraction of tokens where the clipped error is the larger: ``(vf_loss, vf_clipfrac)``.

    :func:`rlops.value_loss` per token, then :func:`agg_loss` with the global normalisers
    (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``), as verl.

    Example:
        >>> import torch
        >>> vf_loss, frac = compute_value_loss(torch.tensor([[1.0, 3.0]]), torch.zeros(1, 2),
        ...                                    torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.5)
        >>> vf_loss, frac
        (tensor(2.5000), tensor(0.))
    """
    check_2d("vpreds", vpreds)
    check_same_shape("vpreds", vpreds, returns=returns, values=values)
    mask = _response_mask(response_mask, "vpreds", vpreds)
    clip = check_positive("cliprange_value", cliprange_value)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    half_mat, metrics = rlops.value_loss(vpreds, values, returns, mask, clip=clip, agg=None)
    loss = agg_loss(
        half_mat,
        mask,
        loss_agg_mode,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor,
    )
    return loss, metrics["vf_clipfrac"]


# --------------------------------------------------------------------------- torch utilities
def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True):
    """``(values − mean)·rsqrt(var + 1e-8)`` with the mean and unbiased variance of the mask-1
    entries; ``shift_mean=False`` adds the mean back. :func:`rlops.masked_whiten`.

    As verl, fewer than two selected entries raise ``ValueError`` (verl's ``masked_var``: no
    selected entry, or one, whose unbiased variance divides by zero); the count is read back to
    the host once, as verl's check does. The variance is two-pass in both, so constant inputs
    are finite in both.

    Difference: mask-0 entries are returned as 0 (verl whitens them too).

    Example:
        >>> import torch
        >>> masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0]))
        tensor([-1.,  0.,  1.,  0.])
    """
    out = rlops.masked_whiten(values, mask, shift_mean=shift_mean, eps=1e-8)  # checks inputs
    selected = int(torch.count_nonzero(mask))
    if selected == 0:
        raise ValueError("mask selects no entry: at least one element of mask has to be 1")
    if selected == 1:
        raise ValueError(
            "mask selects a single entry: its unbiased variance divides by zero; at least two "
            "elements of mask have to be 1"
        )
    return out


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward=True):
    """Log-probability of ``labels`` under ``softmax(logits)``, shape ``logits.shape[:-1]``.

    Fused and chunked (:func:`rlops.logprobs_and_entropy`): no ``[..., V]`` float32 copy of the
    logits, softmax recomputed in the backward. ``inplace_backward`` is accepted and ignored.

    Difference: the result is float32 for bfloat16/float16 logits (verl's fallback path returns
    the logits' dtype).

    Example:
        >>> import torch
        >>> logprobs_from_logits(torch.tensor([[[0.0, 0.0], [2.0, 0.0]]]), torch.tensor([[1, 0]]))
        tensor([[-0.6931, -0.1269]])
    """
    return rlops.logprobs_and_entropy(logits, labels, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension, shape ``logits.shape[:-1]``.

    Fused and chunked; differentiable. Difference: float32 for half-precision logits.

    Example:
        >>> import torch
        >>> entropy_from_logits(torch.zeros(2, 4))
        tensor([1.3863, 1.3863])
    """
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return rlops.logprobs_and_entropy(logits, target, with_entropy=True)[1]


# --------------------------------------------------------------------------- DPPO, bypass mode
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's registered ``"dppo_tv"`` loss (DPPO-Binary-TV): ``(pg_loss, metrics)``.

    ``−A·sg(min(r, clip_ratio_c))·log π`` on the tokens with ``π − π_old ≤ clip_ratio_high``
    (A > 0) or ``≥ −clip_ratio_low`` (A ≤ 0), 0 elsewhere; ``clip_ratio_low`` /
    ``clip_ratio_high`` default to ``clip_ratio`` (here divergence bounds), ``clip_ratio_c`` to
    20 where absent (an ``ActorConfig`` sets it: 3.0). Aggregated with ``loss_agg_mode``.
    Metrics ``actor/pg_clipfrac`` (tokens dropped), ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` (kept tokens with ``r > clip_ratio_c``).
    ``rlops.policy_loss(kind="dppo_tv")``.

    Difference: ``actor/ppo_kl`` is not clamped (verl: the log-ratio clamped to ±20).

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_dppo_tv(torch.tensor([[-1.0, -1.0]]),
        ...     torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), m["actor/pg_clipfrac"]
        (0.5, 0.5)
    """
    return kind_loss(
        "dppo_tv",
        agg_loss,
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
    """verl's registered ``"dppo_kl"`` loss (DPPO-Binary-KL): ``(pg_loss, metrics)``.

    As :func:`compute_policy_loss_dppo_tv` with the Bernoulli KL ``π_old·log(π_old/π) +
    (1 − π_old)·log((1 − π_old)/(1 − π))``: a token stays where it is ``≤ clip_ratio_high`` or
    ``π ≤ π_old`` (A > 0), ``≤ clip_ratio_low`` or ``π ≥ π_old`` (A ≤ 0).
    ``rlops.policy_loss(kind="dppo_kl")``.

    Differences: the KL is computed without verl's ``+ 1e-8`` in ``1 − π`` (a token with
    ``π = 1`` has an infinite KL, as the definition); ``actor/ppo_kl`` is not clamped.

    Example:
        >>> import torch
        >>> loss, m = compute_policy_loss_dppo_kl(torch.tensor([[-1.0, -1.0]]),
        ...     torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"clip_ratio": 0.2})
        >>> m["actor/pg_clipfrac"]
        0.0
    """
    return kind_loss(
        "dppo_kl",
        agg_loss,
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
    """verl's registered ``"bypass_mode"`` loss: ``(pg_loss, metrics)``; ``old_log_prob`` are
    the sampler's log-probs (π_old = π_rollout).

    A composition: :func:`compute_rollout_correction_and_rejection_mask` of ``(log_prob``
    detached, ``old_log_prob)`` with ``config.policy_loss.rollout_correction``'s
    ``rollout_is`` / ``rollout_is_threshold`` (2.0) / ``rollout_is_batch_normalize`` /
    ``rollout_rs`` / ``rollout_rs_threshold``, then, by its ``loss_type``: ``"ppo_clip"``
    (default) :func:`compute_policy_loss_vanilla` on the rejection mask without IS weights, or
    ``"reinforce"`` ``−w·A·log π`` (``rlops.policy_loss(kind="reinforce")`` with the IS
    weights ``w``) aggregated with ``loss_agg_mode``. ``rollout_is_weights`` is ignored (as
    verl). Metrics: the loss's, and the rollout correction's under ``rollout_corr/``.

    Example:
        >>> import torch
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


POLICY_LOSS_REGISTRY.update(
    {
        "dppo_tv": compute_policy_loss_dppo_tv,
        "dppo_kl": compute_policy_loss_dppo_kl,
        "bypass_mode": compute_policy_loss_bypass_mode,
    }
)
