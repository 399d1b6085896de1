"""PPO-family losses on ``[B, T]`` token tensors: KL estimators, policy and value losses, and the
aggregation of a per-token loss matrix into a scalar.

Modules: ``aggregation`` (:func:`aggregate_loss`, the modes, the global normalisers and
:class:`AggregationOptions`, the keywords every loss passes to its aggregation),
``kl`` (:func:`kl_penalty`), ``entropy`` (:func:`entropy_loss`), ``kinds`` (the per-token
loss of each policy-loss kind), ``policy`` (:func:`policy_loss`), ``value`` (:func:`value_loss`);
``_checks`` holds the package's argument checks (each public function checks once, then calls
unchecked internals), ``_common`` its shared constant and rule.

Numerical rules:

* Every argument of ``exp`` is clamped to at most ``MAX_EXP_ARG = 20`` (``e^20 ≈ 4.9e8``, finite
  in float32 and bfloat16). Outside the clamp the value saturates and its gradient is 0.
  Sequence-level ratios are means of log-ratios, never products of ratios.
* Half-precision inputs are computed in float32. Scalar losses and metrics are returned in the
  computation dtype (float32 for half inputs, as under autocast); per-token KL values are
  returned in the input dtype, saturated to its finite range (float16 cannot hold ``e^20``).
* Entries with mask 0 are replaced with ``torch.where`` before any arithmetic, so NaN/inf there
  (padding) reaches neither the loss nor any gradient: their gradient is exactly 0.
* Nothing reads a value back to the host; metrics are detached 0-dim tensors.
* Inputs that stand for a fixed policy or a target (``old_logp``, ``ref_logp``, ``old_values``,
  ``returns``, advantages, ``rollout_is_weights``, the global counts) are constants: detached
  once where a public function receives them, so the gradient reaches the live input only.
"""

from rlops.losses._common import MAX_EXP_ARG
from rlops.losses.aggregation import AGG_MODES, AggregationOptions, aggregate_loss
from rlops.losses.entropy import entropy_loss
from rlops.losses.kl import KL_KINDS, kl_penalty
from rlops.losses.policy import POLICY_KINDS, PolicyLossOptions, policy_loss
from rlops.losses.value import value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "MAX_EXP_ARG",
    "POLICY_KINDS",
    "AggregationOptions",
    "PolicyLossOptions",
    "aggregate_loss",
    "entropy_loss",
    "kl_penalty",
    "policy_loss",
    "value_loss",
]
