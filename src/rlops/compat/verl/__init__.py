"""verl's estimators, losses, rollout correction and torch utilities, on rlops.

Drop-in replacements with verl's names, arguments and return tuples (``core_algos.py``,
``rollout_corr_helper.py``, ``torch_functional.py``); differences: docs/integration.md.
"""

from rlops.compat.verl._advantages import (
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from rlops.compat.verl._distillation import compute_forward_kl_topk
from rlops.compat.verl._losses import agg_loss, compute_value_loss, kl_penalty
from rlops.compat.verl._metrics import compute_is_metrics, compute_rs_metrics
from rlops.compat.verl._policy_losses import (
    POLICY_LOSS_REGISTRY,
    compute_policy_loss,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
)
from rlops.compat.verl._rollout import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from rlops.compat.verl._torch_functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_whiten,
)

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "compute_forward_kl_topk",
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
