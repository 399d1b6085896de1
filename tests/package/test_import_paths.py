"""Every public import path of rlops keeps working: each module path below imports, and each
name it listed in ``__all__`` when the path was pinned is still there under the same path.

A path may be a package, a module, or a thin module that re-exports a family from the package it
now lives in (``rlops.kl_controllers`` from ``rlops.losses``; ``rlops.selection``,
``rlops.rollout_correction`` from ``rlops.corrections``; ``rlops.group_advantages`` from
``rlops.advantages``). New names may be added; none may go.
"""

from __future__ import annotations

import importlib

import pytest

PINNED: dict[str, tuple[str, ...]] = {
    "rlops": (
        "aggregate_loss",
        "behavior_importance_weights",
        "discounted_cumsum",
        "discounted_returns",
        "entropy_loss",
        "gae",
        "gdpo_advantages",
        "gpg_advantages",
        "grpo_advantages",
        "grpo_passk_advantages",
        "kl_penalty",
        "linear_logprobs_and_entropy",
        "logprobs_and_entropy",
        "m2po_mask",
        "masked_mean",
        "masked_var",
        "masked_whiten",
        "opo_advantages",
        "opsm_mask",
        "optimal_token_baseline_advantages",
        "policy_loss",
        "reinforce_plus_plus_baseline_advantages",
        "reinforce_plus_plus_returns",
        "remax_advantages",
        "rloo_advantages",
        "rollout_importance_weights",
        "rollout_mismatch_metrics",
        "rollout_rejection_mask",
        "top_entropy_mask",
        "value_loss",
    ),
    "rlops.advantages": (
        "discounted_cumsum",
        "discounted_returns",
        "gae",
        "reinforce_plus_plus_returns",
    ),
    "rlops.distributed": (
        "CP_LAYOUTS",
        "contiguous_indices",
        "contiguous_shard",
        "contiguous_unshard",
        "cp_indices",
        "cp_shard",
        "cp_unshard",
        "zigzag_indices",
        "zigzag_shard",
        "zigzag_unshard",
    ),
    "rlops.logprobs": (
        "LogprobOptions",
        "copy_to_tensor_parallel_region",
        "linear_logprobs_and_entropy",
        "logprobs_and_entropy",
    ),
    "rlops.losses": (
        "AGG_MODES",
        "AggregationOptions",
        "KL_KINDS",
        "MAX_EXP_ARG",
        "POLICY_KINDS",
        "PolicyLossOptions",
        "aggregate_loss",
        "entropy_loss",
        "kl_penalty",
        "policy_loss",
        "value_loss",
    ),
    "rlops.scan": (
        "METHODS",
        "SCAN",
        "is_per_token",
        "scan",
    ),
    "rlops.stats": (
        "Moments",
        "masked_mean",
        "masked_moments",
        "masked_var",
        "masked_whiten",
        "merge_moments",
        "weighted_moments",
    ),
    "rlops.testing": (
        "ADVANTAGE_CHECKS",
        "Check",
        "ContractError",
        "LOGPROB_CHECKS",
        "POLICY_LOSS_CHECKS",
        "Report",
        "check_advantages",
        "check_logprobs",
        "check_policy_loss",
    ),
    "rlops.measure": (
        "baselines",
        "options",
        "plot",
        "ppo",
        "sections",
        "timing",
        "workloads",
    ),
    "rlops.kl_controllers": (
        "AdaptiveKLController",
        "FixedKLController",
        "get_kl_controller",
        "kl_controller",
    ),
    "rlops.selection": (
        "BEHAVIOR_ACTIONS",
        "BEHAVIOR_AGGS",
        "BEHAVIOR_LEVELS",
        "behavior_importance_weights",
        "m2po_mask",
        "opsm_mask",
        "top_entropy_mask",
    ),
    "rlops.rollout_correction": (
        "IS_LEVELS",
        "IS_MODES",
        "RS_OPTIONS",
        "rollout_importance_weights",
        "rollout_mismatch_metrics",
        "rollout_rejection_mask",
    ),
    "rlops.group_advantages": (
        "gdpo_advantages",
        "gpg_advantages",
        "grpo_advantages",
        "grpo_passk_advantages",
        "opo_advantages",
        "optimal_token_baseline_advantages",
        "reinforce_plus_plus_baseline_advantages",
        "remax_advantages",
        "rloo_advantages",
    ),
    "rlops.compat.verl": (
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
    ),
    "rlops.compat.slime": (
        "add_outcome_rewards",
        "all_gather_with_cp",
        "calculate_log_probs_and_entropy",
        "chunked_discounted_returns",
        "chunked_gae",
        "compute_approx_kl",
        "compute_cispo_loss",
        "compute_opsm_mask",
        "compute_policy_loss",
        "distributed_masked_whiten",
        "get_advantages_and_returns_batch",
        "get_grpo_returns",
        "get_log_probs_and_entropy",
        "get_reinforce_plus_plus_baseline_advantages",
        "get_reinforce_plus_plus_returns",
        "icepop_function",
        "slice_log_prob_with_cp",
        "value_loss_function",
        "vanilla_gae",
        "vanilla_tis_function",
        "zigzag_response_mask",
        "zigzag_shard_response",
        "zigzag_unshard_response",
    ),
    "rlops.compat.trl": (
        "GRPOMixin",
        "LOSS_TYPES",
        "SUPPORTED_TRL",
        "grpo_advantages",
        "grpo_loss",
        "patch",
    ),
    "rlops.compat.vllm": (
        "LOGPROBS_MODES",
        "logprob_options",
    ),
    "rlops.compat.sglang": (
        "RL_ON_POLICY_TARGETS",
        "logprob_options",
    ),
}


@pytest.mark.parametrize("path", sorted(PINNED))
def test_public_import_path_keeps_its_names(path: str) -> None:
    module = importlib.import_module(path)
    missing = [name for name in PINNED[path] if not hasattr(module, name)]
    assert not missing, f"{path} lost {missing}"
    listed = set(getattr(module, "__all__", ()))
    assert set(PINNED[path]) <= listed, f"{path}.__all__ lost {sorted(set(PINNED[path]) - listed)}"


@pytest.mark.parametrize("path", sorted(PINNED))
def test_from_import_form_works(path: str) -> None:
    namespace: dict[str, object] = {}
    for name in PINNED[path]:
        exec(f"from {path} import {name}", namespace)  # the form users write
        assert namespace[name] is getattr(importlib.import_module(path), name)
