"""Numerical limits shared by every module.

``MAX_EXP_ARG = 20``: the largest argument of any ``exp`` of a log-ratio or log-weight (policy
ratios, importance weights, their diagnostics). ``e^20 ≈ 4.9e8`` and ``e^40`` (a squared
weight) are finite in float32 and bfloat16, so a clamped ratio never becomes inf, and no
ratio an RL step should see comes near it. verl clamps at the same value (its
``SAFETY_BOUND``).
"""

from __future__ import annotations

MAX_EXP_ARG = 20.0
