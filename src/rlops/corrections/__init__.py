"""Corrections for the gap between the sampling and the trained policy: rollout importance
weights, rejection masks and diagnostics, and batch-wide selection masks."""

from rlops.corrections.rollout import (
    IS_LEVELS,
    IS_MODES,
    RS_OPTIONS,
    rollout_importance_weights,
    rollout_mismatch_metrics,
    rollout_rejection_mask,
)
from rlops.corrections.selection import (
    BEHAVIOR_ACTIONS,
    BEHAVIOR_AGGS,
    BEHAVIOR_LEVELS,
    behavior_importance_weights,
    m2po_mask,
    opsm_mask,
    top_entropy_mask,
)

__all__ = [
    "BEHAVIOR_ACTIONS",
    "BEHAVIOR_AGGS",
    "BEHAVIOR_LEVELS",
    "IS_LEVELS",
    "IS_MODES",
    "RS_OPTIONS",
    "behavior_importance_weights",
    "m2po_mask",
    "opsm_mask",
    "rollout_importance_weights",
    "rollout_mismatch_metrics",
    "rollout_rejection_mask",
    "top_entropy_mask",
]
