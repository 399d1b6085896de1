"""rlops: the numerical core of reinforcement learning on language models.

Advantages and returns (one discounted reverse scan), group estimators, KL estimators, policy
and value losses, masked statistics, log-probs and entropy, rollout correction and selection
masks, and the distributed pieces they need, as pure functions on ``[B, T]`` tensors.
"""

# the kept import paths, as attributes after ``import rlops`` (rlops.kl_controllers.X, ...)
from rlops import group_advantages as group_advantages
from rlops import kl_controllers as kl_controllers
from rlops import rollout_correction as rollout_correction
from rlops import selection as selection
from rlops.advantages import (
    discounted_cumsum,
    discounted_returns,
    gae,
    reinforce_plus_plus_returns,
)
from rlops.advantages.agentic import gigpo_advantages
from rlops.advantages.group import (
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    maxrl_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlops.advantages.shaping import overlong_penalty
from rlops.corrections.rollout import (
    rollout_importance_weights,
    rollout_mismatch_metrics,
    rollout_rejection_mask,
)
from rlops.corrections.selection import (
    behavior_importance_weights,
    m2po_mask,
    opsm_mask,
    top_entropy_mask,
)
from rlops.distillation import distillation_loss, linear_distillation_loss
from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.losses import (
    aggregate_loss,
    entropy_loss,
    kl_penalty,
    linear_policy_loss,
    policy_loss,
    value_loss,
)
from rlops.stats import masked_mean, masked_var, masked_whiten

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

__all__ = [
    "aggregate_loss",
    "behavior_importance_weights",
    "discounted_cumsum",
    "discounted_returns",
    "distillation_loss",
    "entropy_loss",
    "gae",
    "gdpo_advantages",
    "gigpo_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "kl_penalty",
    "linear_distillation_loss",
    "linear_logprobs_and_entropy",
    "linear_policy_loss",
    "logprobs_and_entropy",
    "m2po_mask",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "maxrl_advantages",
    "opo_advantages",
    "opsm_mask",
    "optimal_token_baseline_advantages",
    "overlong_penalty",
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
]
