"""The public API is pinned: nothing leaks, nothing vanishes by accident."""

import rlops

EXPECTED = [
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


def test_exports_are_pinned_and_sorted():
    assert rlops.__all__ == sorted(rlops.__all__)
    assert rlops.__all__ == EXPECTED


def test_every_export_is_documented_with_an_example():
    for name in rlops.__all__:
        doc = getattr(rlops, name).__doc__
        assert doc and ">>>" in doc, name
