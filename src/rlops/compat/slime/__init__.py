"""slime's estimators, losses, corrections, log-probs and context-parallel helpers, on rlops.

On slime's per-sample lists; Megatron's global state becomes a group argument (docs/integration.md).
"""

from rlops.compat.slime._advantages import (
    chunked_discounted_returns,
    chunked_gae,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    vanilla_gae,
)
from rlops.compat.slime._corrections import compute_opsm_mask, icepop_function, vanilla_tis_function
from rlops.compat.slime._cp import (
    add_outcome_rewards,
    all_gather_with_cp,
    slice_log_prob_with_cp,
    zigzag_response_mask,
    zigzag_shard_response,
    zigzag_unshard_response,
)
from rlops.compat.slime._logprobs import calculate_log_probs_and_entropy, get_log_probs_and_entropy
from rlops.compat.slime._losses import (
    compute_approx_kl,
    compute_cispo_loss,
    compute_policy_loss,
    value_loss_function,
)

__all__ = [
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
]
