"""TRL's GRPO on rlops (TRL 1.16's ``trl/trainer/grpo_trainer.py``, :data:`SUPPORTED_TRL`).

:func:`grpo_advantages` and :func:`grpo_loss` take TRL's names and need torch alone;
:class:`GRPOMixin` (``class Trainer(GRPOMixin, trl.GRPOTrainer)``) and :func:`patch` (TRL's
fused LM head) import TRL when used. How each option maps: docs/integration-trl.md.
"""

from rlops.compat.trl._advantages import grpo_advantages
from rlops.compat.trl._head import patch
from rlops.compat.trl._loss import LOSS_TYPES, grpo_loss
from rlops.compat.trl._mixin import SUPPORTED_TRL, GRPOMixin

__all__ = ["LOSS_TYPES", "SUPPORTED_TRL", "GRPOMixin", "grpo_advantages", "grpo_loss", "patch"]
