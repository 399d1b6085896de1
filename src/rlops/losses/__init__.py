"""PPO-family losses on ``[B, T]`` tensors: per-token matrices, one aggregation (verl's modes),
KL estimators and controllers; numerical rules in docs/design/losses.md."""

from rlops.losses._common import MAX_EXP_ARG
from rlops.losses.aggregation import AGG_MODES, AggregationOptions, aggregate_loss
from rlops.losses.entropy import entropy_loss
from rlops.losses.kl import KL_KINDS, kl_penalty
from rlops.losses.kl_controllers import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_controller,
)
from rlops.losses.linear import ONE_PASS_KINDS, linear_policy_loss
from rlops.losses.policy import POLICY_KINDS, PolicyLossOptions, policy_loss
from rlops.losses.value import value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "MAX_EXP_ARG",
    "ONE_PASS_KINDS",
    "POLICY_KINDS",
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "AggregationOptions",
    "FixedKLController",
    "PolicyLossOptions",
    "aggregate_loss",
    "entropy_loss",
    "get_kl_controller",
    "kl_controller",
    "kl_penalty",
    "linear_policy_loss",
    "policy_loss",
    "value_loss",
]
