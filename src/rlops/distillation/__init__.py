"""On-policy distillation: the per-token divergence between a teacher's top-k (with its tail)
or full distribution and the student's softmax, from logits or from hidden states.

- :func:`distillation_loss`: from logits ``[..., V_local]``.
- :func:`linear_distillation_loss`: from hidden states and the output layer, never building
  the logits.

The float64 definition lives in :mod:`rlops.distillation.reference`.
"""

from rlops.distillation.linear import linear_distillation_loss
from rlops.distillation.loss import distillation_loss

__all__ = ["distillation_loss", "linear_distillation_loss"]
