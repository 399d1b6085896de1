"""verl's advantage estimators (``verl/trainer/ppo/core_algos.py``), one rlops call each."""

from __future__ import annotations

from typing import Any

import torch

import rlops
from rlops._checks import (
    as_float_tensor,
    as_real_vector,
    check_2d,
    check_bool,
    check_nonneg,
    check_positive,
    check_same_shape,
    check_unit_interval,
    shape_error,
)
from rlops.compat.verl._config import config_value, group_ids, outcome_inputs, response_mask


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma,
    lam,
):
    """GAE (https://arxiv.org/abs/1506.02438) over the mask-1 tokens, whitened: ``(adv, returns)``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> adv, ret = compute_gae_advantage_return(r, torch.zeros(2, 3), torch.ones(2, 3),
        ...                                         gamma=1.0, lam=1.0)
        >>> ret
        tensor([[1., 1., 1.],
                [1., 1., 0.]])
    """
    check_2d("token_level_rewards", token_level_rewards)
    check_same_shape("token_level_rewards", token_level_rewards, values=values)
    mask = _mask(response_mask, token_level_rewards)
    gamma, lam = check_unit_interval("gamma", gamma), check_unit_interval("lam", lam)
    with torch.no_grad():
        adv, ret = rlops.gae(token_level_rewards, values, gamma=gamma, lam=lam, mask=mask)
        return rlops.masked_whiten(adv, mask), ret


def _mask(mask: object, rewards: torch.Tensor) -> torch.Tensor:
    """verl's ``response_mask`` of ``token_level_rewards``, as bool."""
    return response_mask(mask, "token_level_rewards", rewards)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
):
    """GRPO (https://arxiv.org/abs/2402.03300): scores standardised in their ``index`` groups.

    Example:
        >>> import numpy as np
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
    """RLOO: each score minus the mean of the others in its group: ``(advantages, advantages)``.

    Example:
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
    """REINFORCE++-baseline: score minus its group mean, whitened over the batch.

    Example:
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
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted over the mask-1 tokens, whitened.

    Example:
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
    """ReMax (https://arxiv.org/abs/2310.10505): reward-to-go minus ``reward_baselines`` ``[bs]``.

    Example:
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


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
):
    """OPO (https://arxiv.org/abs/2505.23585): score minus its group's length-weighted mean score.

    Example:
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
    """GPG (https://arxiv.org/abs/2504.02546): ``α·(s − μ_g) / f_norm``, ``α = bs / #non-zero``.

    Example:
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
    """GRPO pass@k (https://arxiv.org/abs/2503.19595): the best sample gets ``r_max − r_second``.

    Example:
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
    """GDPO (https://arxiv.org/abs/2601.05242): reward components standardised, summed, whitened.

    Example:
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
        scores, weights = _gdpo_components(config, non_tensor_batch, device)
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


def _gdpo_components(config: object, non_tensor_batch: Any, device: torch.device):
    """GDPO's scores ``[bs, K]`` of ``config['gdpo_reward_keys']`` and their weights."""
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

    columns = [np.asarray(non_tensor_batch[k], dtype=np.float32) for k in keys]
    scores = torch.stack([torch.as_tensor(c, device=device) for c in columns], -1)
    weights = config_value(config, "gdpo_reward_weights")
    if weights is not None:
        weights = as_real_vector(
            "config['gdpo_reward_weights']",
            weights,
            len(keys),
            "the scores of config['gdpo_reward_keys']",
        )
    return scores, weights


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
    """Both optimal-token-baseline estimators, arguments checked under verl's names."""
    mask = outcome_inputs(token_level_rewards, response_mask)
    for name, x in (
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if x is not None:
            as_float_tensor(name, x)
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
    """The optimal token baseline (https://arxiv.org/abs/2602.07078), per column of the group.

    Example:
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
    """The optimal token baseline's multi-turn form: positions counted in action tokens.

    Example:
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
