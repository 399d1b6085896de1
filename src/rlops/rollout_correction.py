"""Rollout-training mismatch correction: the import path ``rlops.rollout_correction``, kept.

The family lives in :mod:`rlops.corrections` (``rlops.corrections.rollout``);
this module only re-exports it.
"""

from rlops.corrections.rollout import *  # noqa: F403
from rlops.corrections.rollout import __all__ as __all__
