"""Estimators for multi-turn agents, one row per step of an episode: GiGPO's episode- and
step-level group advantages, with ROLL's conventions (``roll/pipeline/agentic/utils.py``)."""

from __future__ import annotations

import torch

from rlops._checks import (
    as_bool_mask,
    as_float_tensor,
    check_bool,
    check_ids,
    check_matrix,
    check_nonneg,
    check_same_device,
    shape_error,
)
from rlops.advantages.group import _broadcast, _dense_group_ids, _group_moments

__all__ = ["gigpo_advantages"]


def _normalised(x: torch.Tensor, gid: torch.Tensor, norm_std: bool, eps: float) -> torch.Tensor:
    """ROLL's ``agentic_reward_norm`` by group: ``x − μ``, over ``σ + eps`` with ``norm_std``
    (unbiased σ); 0 for a group of one and, with ``norm_std``, where ``σ <= eps``."""
    n, centred, std = _group_moments(x, gid)
    a = centred
    if norm_std:
        spread = std > eps
        a = torch.where(spread, centred / torch.where(spread, std + eps, 1), 0.0)
    return torch.where(n > 1, a, 0.0)


def gigpo_advantages(
    episode_scores: torch.Tensor,
    index: torch.Tensor,
    step_rewards: torch.Tensor,
    anchor_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    episode_reward_weight: float = 1.0,
    step_reward_weight: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (https://arxiv.org/abs/2505.10978): each row one step of an agent's episode; the
    episode's score normalised within its ``index`` group (episodes of one task) plus the
    step's return normalised within its anchor-state group (steps of that group that start
    from the same state):

        A_i = w_e·N_index(S)_i + w_s·N_(index, anchor)(G)_i
        N_g(x)_i = (x_i − μ_g) / (σ_g + eps)    (norm_std=False: x_i − μ_g)

    ROLL's ``compute_response_level_rewards`` (``adv_estimator="gigpo"``, ``method``
    ``mean_std``, or ``mean`` for ``norm_std=False``) and its edges: σ unbiased, a group of
    one gets 0, a σ ``<= eps`` gives 0; every row counts, so an episode of k steps weighs k
    times in its group (verl-agent's default, ``compute_mean_std_cross_steps``); rows
    without action tokens count too and get 0. ROLL groups steps by the state hash alone,
    rlops by the pair (as the paper): the same where a state never appears in two ``index``
    groups (else ROLL's step part is a second call with a single ``index`` and
    ``episode_reward_weight=0``).

    Args:
        episode_scores: ``[B]`` the score of each row's episode (ROLL's ``episode_scores``).
        index: ``[B]`` integer episode-group id per row (ROLL's ``traj_group_id``).
        step_rewards: ``[B]`` the step's discounted return within its episode (ROLL's
            ``step_rewards``, from ``compute_discounted_returns``; ``rlops.discounted_returns``
            over an ``[episodes, steps]`` layout gives it).
        anchor_ids: ``[B]`` integer id of the state the step starts from (a state hash);
            group ids from strings: ``numpy.unique(ids, return_inverse=True)[1]``.
        mask: ``[B, T]`` 0/1 action mask.
        episode_reward_weight: ``>= 0``, ``w_e``.
        step_reward_weight: ``>= 0``, ``w_s``.
        norm_std: divide by the group std (``mean_std``) or not (``mean``).
        eps: ``>= 0``, the std's floor and addend (ROLL's fixed ``1e-6``).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor in the dtype of
        ``episode_scores``, 0 on mask-0 tokens.

    Example:
        >>> import torch
        >>> episode, step = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, 0.5, 0.0, 0.0])
        >>> adv, _ = gigpo_advantages(episode, torch.zeros(4, dtype=torch.long), step,
        ...                           torch.tensor([7, 8, 7, 8]), torch.ones(4, 1), norm_std=False)
        >>> adv[:, 0]  # episode: ±0.5; state 7: ±0.5, state 8: ±0.25
        tensor([ 1.0000,  0.7500, -1.0000, -0.7500])
    """
    eps = check_nonneg("eps", eps)
    w_e = check_nonneg("episode_reward_weight", episode_reward_weight)
    w_s = check_nonneg("step_reward_weight", step_reward_weight)
    norm_std = check_bool("norm_std", norm_std)
    episode_scores = as_float_tensor("episode_scores", episode_scores)
    step_rewards = as_float_tensor("step_rewards", step_rewards)
    b, t = check_matrix("mask", mask)
    for name, x in (("episode_scores", episode_scores), ("step_rewards", step_rewards)):
        if tuple(x.shape) != (b,):
            raise shape_error(name, f"[B] = {[b]} like mask", x.shape)
    as_bool_mask("mask", mask, (b, t), "[B, T]")
    check_ids("index", index, (b,), "episode_scores")
    check_ids("anchor_ids", anchor_ids, (b,), "episode_scores")
    check_same_device(
        "episode_scores",
        episode_scores,
        index=index,
        step_rewards=step_rewards,
        anchor_ids=anchor_ids,
        mask=mask,
    )
    gid = _dense_group_ids(index)
    pair = _dense_group_ids(gid * b + _dense_group_ids(anchor_ids))
    a = w_e * _normalised(episode_scores, gid, norm_std, eps)
    a = a + w_s * _normalised(step_rewards, pair, norm_std, eps)
    adv = _broadcast(a, mask, episode_scores.dtype)
    return adv, adv
