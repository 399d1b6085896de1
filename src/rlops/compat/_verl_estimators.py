"""verl's OPO, GPG, GRPO pass@k, GDPO and optimal-token-baseline estimators on rlops
(``verl/trainer/ppo/core_algos.py``: ``compute_opo_outcome_advantage``,
``compute_gpg_outcome_advantage``, ``compute_grpo_passk_outcome_advantage``,
``compute_gdpo_outcome_advantage``, ``compute_optimal_token_baseline_advantage``,
``compute_multi_turn_optimal_token_baseline_advantage``), with verl's signatures and return
tuples. Each is one rlops call: no loop over samples or groups (verl loops over both).
"""

from __future__ import annotations

from typing import Any

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_float_tensor,
    as_real_vector,
    check_2d,
    check_bool,
    check_nonneg,
    check_positive,
)
from rlops.compat._verl_kinds import config_value

__all__ = [
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "group_ids",
    "outcome_inputs",
]


def outcome_inputs(token_level_rewards: object, response_mask: object) -> torch.Tensor:
    """``token_level_rewards`` ``[bs, T]`` and its ``response_mask``, returned as bool."""
    rewards = check_2d("token_level_rewards", token_level_rewards)
    return as_bool_mask(
        "response_mask", response_mask, rewards.shape, "token_level_rewards", rewards
    )


def group_ids(index: object, device: torch.device) -> torch.Tensor:
    """verl's ``index`` (an array of uids, often strings) as integer group ids ``[bs]``."""
    if isinstance(index, torch.Tensor) and not index.is_floating_point():
        return index.to(device)
    import numpy as np  # verl passes numpy arrays of uids; numpy comes with verl

    ids = np.unique(np.asarray(index), return_inverse=True)[1]
    return torch.as_tensor(ids.reshape(-1), device=device)


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
):
    """OPO (https://arxiv.org/abs/2505.23585): each score minus its group's length-weighted
    mean score ``Σ L·s / Σ L`` (``L``: the rows' mask sums; a group of one has baseline 0),
    broadcast over the mask-1 tokens; ``(advantages, advantages)``. ``epsilon`` is unused, as
    in verl. :func:`rlops.opo_advantages`.

    Example:
        >>> import torch
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> adv, _ = compute_opo_outcome_advantage(torch.tensor([[0.0, 0, 1], [0, 0, 0]]), m,
        ...                                        ["a", "a"])
        >>> adv[:, 0]   # baseline (3·1 + 1·0) / 4
        tensor([ 0.2500, -0.7500])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        return rlops.opo_advantages(
            token_level_rewards, group_ids(index, token_level_rewards.device), mask
        )


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config=None,
    **kwargs,
):
    """GPG (https://arxiv.org/abs/2504.02546): ``α·(s − μ_g) / f_norm`` with
    ``α = bs / max(#non-zero scores, 1)`` (verl computes ``α`` so and ignores its ``alpha``
    argument; so does this), a group of one has ``μ = 0``; ``(advantages, advantages)``.
    :func:`rlops.gpg_advantages`.

    Example:
        >>> import torch
        >>> adv, _ = compute_gpg_outcome_advantage(
        ...     torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1), [0, 0, 1, 1])
        >>> adv[:, 0]
        tensor([ 2., -2.,  0.,  0.])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    f_norm = check_positive("f_norm", f_norm)
    with torch.no_grad():
        return rlops.gpg_advantages(
            token_level_rewards, group_ids(index, token_level_rewards.device), mask, f_norm=f_norm
        )


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
):
    """GRPO pass@k (https://arxiv.org/abs/2503.19595): only each group's best sample gets an
    advantage, ``r_max − r_second_max`` (divided by ``std + epsilon`` with
    ``norm_adv_by_std_in_grpo``); ``(advantages, advantages)``. As verl, the flag is read from
    ``config`` (default True) when a config is given; every group needs 2 samples.
    :func:`rlops.grpo_passk_advantages`.

    Difference: ``config=None`` uses the argument (verl asserts a config is given); where the
    top score ties, every sample gets 0 (verl gives its top-k pick ``r_max − r_max = 0`` too).

    Example:
        >>> import torch
        >>> adv, _ = compute_grpo_passk_outcome_advantage(
        ...     torch.tensor([[0.0], [3.0], [1.0]]), torch.ones(3, 1), [0, 0, 0],
        ...     config={"norm_adv_by_std_in_grpo": False})
        >>> adv[:, 0]
        tensor([0., 2., 0.])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    epsilon = check_nonneg("epsilon", epsilon)
    norm = config_value(config, "norm_adv_by_std_in_grpo") if config is not None else None
    norm = check_bool("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo if norm is None else norm)
    with torch.no_grad():
        return rlops.grpo_passk_advantages(
            token_level_rewards,
            group_ids(index, token_level_rewards.device),
            mask,
            norm_std=norm,
            eps=epsilon,
        )


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    non_tensor_batch=None,
    batch=None,
    **kwargs,
):
    """GDPO (https://arxiv.org/abs/2601.05242): each reward component standardised within its
    group (GRPO), weighted, summed, then whitened over the mask-1 tokens;
    ``(advantages, advantages)``.

    As verl: with ``config``, ``non_tensor_batch`` and ``batch`` all given, the components are
    ``non_tensor_batch[key]`` for each key of ``config["gdpo_reward_keys"]`` (one score per
    sample) and the weights ``config["gdpo_reward_weights"]`` (default 1); otherwise the one
    component is the row sum of ``token_level_rewards``. :func:`rlops.gdpo_advantages`.

    Difference: a batch with a single or no mask-1 token gives 0 (verl's ``masked_whiten``
    raises ``ValueError``).

    Example:
        >>> import torch
        >>> adv, _ = compute_gdpo_outcome_advantage(
        ...     torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0]]),
        ...     torch.ones(4, 2), [0, 0, 1, 1])
        >>> adv[:, 0]
        tensor([ 0.9354, -0.9354,  0.9354, -0.9354])
    """
    mask = outcome_inputs(token_level_rewards, response_mask)
    epsilon = check_nonneg("epsilon", epsilon)
    device = token_level_rewards.device
    weights: Any = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys: Any = config_value(config, "gdpo_reward_keys")
        if not keys:
            raise ValueError(
                "GDPO requires config['gdpo_reward_keys'] listing the reward "
                "component keys returned by compute_score"
            )
        missing = [k for k in keys if k not in non_tensor_batch]
        if missing:
            raise ValueError(
                f"GDPO reward keys {missing} not found in non_tensor_batch "
                f"(available: {sorted(non_tensor_batch)})"
            )
        import numpy as np  # verl's non_tensor_batch holds numpy arrays

        scores = torch.stack(
            [
                torch.as_tensor(np.asarray(non_tensor_batch[k], dtype=np.float32), device=device)
                for k in keys
            ],
            -1,
        )
        weights = config_value(config, "gdpo_reward_weights")
        if weights is not None:
            weights = as_real_vector(
                "config['gdpo_reward_weights']",
                weights,
                len(keys),
                "the scores of config['gdpo_reward_keys']",
            )
    else:
        scores = token_level_rewards.sum(-1, keepdim=True)
    with torch.no_grad():
        return rlops.gdpo_advantages(
            scores,
            group_ids(index, device),
            mask,
            weights=weights,
            norm_std=check_bool("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo),
            eps=epsilon,
            whiten_eps=1e-8,
        )


def _otb(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights,
    handle_zero_tail,
    epsilon,
    per_action_step,
):
    mask = outcome_inputs(token_level_rewards, response_mask)
    for name, x in (
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if x is not None:
            as_float_tensor(name, x)  # under verl's names
    with torch.no_grad():
        return rlops.optimal_token_baseline_advantages(
            token_level_rewards,
            group_ids(index, token_level_rewards.device),
            mask,
            old_log_probs,
            sum_pi_squared,
            rollout_is_weights=rollout_is_weights,
            handle_zero_tail=check_bool("handle_zero_tail", handle_zero_tail),
            eps=check_nonneg("epsilon", epsilon),
            per_action_step=per_action_step,
        )


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
):
    """The optimal token baseline (https://arxiv.org/abs/2602.07078): per column ``t``,
    ``B_t = Σ G_t·W_t / (Σ W_t + epsilon)`` over the group's samples alive at ``t``, with
    ``W_t`` the cumulative ``(1 − 2π + Σπ²)·ρ²``; ``(advantages, returns)``, ``returns`` the
    reward-to-go ``G``. :func:`rlops.optimal_token_baseline_advantages`.

    Difference: ``returns`` is 0 on mask-0 tokens (verl leaves the reward-to-go there).

    Example:
        >>> import torch
        >>> adv, ret = compute_optimal_token_baseline_advantage(
        ...     torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2), ["p", "p"],
        ...     torch.full((2, 2), -0.7), torch.full((2, 2), 0.3))
        >>> adv
        tensor([[ 0.5000,  0.5000],
                [-0.5000, -0.5000]])
    """
    return _otb(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        False,
    )


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
):
    """The optimal token baseline's TIR (multi-turn) form: as
    :func:`compute_optimal_token_baseline_advantage` with positions counted in action tokens
    (the k-th action token of each sample against the k-th of the others; tool spans skipped;
    samples without action tokens not counted in their group); ``(advantages, returns)``.
    :func:`rlops.optimal_token_baseline_advantages` with ``per_action_step=True``.

    Difference: ``returns`` is 0 on mask-0 tokens (verl leaves the reward-to-go there).

    Example:
        >>> import torch
        >>> m = torch.tensor([[1, 0, 1], [1, 1, 0]])   # a tool token inside the first row
        >>> adv, _ = compute_multi_turn_optimal_token_baseline_advantage(
        ...     torch.tensor([[0.0, 0, 1], [0, 0, 0]]), m, ["p", "p"],
        ...     torch.full((2, 3), -0.7), torch.full((2, 3), 0.3))
        >>> adv
        tensor([[ 0.5000,  0.0000,  0.5000],
                [-0.5000, -0.5000,  0.0000]])
    """
    return _otb(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        True,
    )
