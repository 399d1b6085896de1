"""Numbers and rules shared by the loss modules (private to the package)."""

from __future__ import annotations

from typing import overload

import torch

from rlops._numerics import MAX_EXP_ARG

__all__ = ["MAX_EXP_ARG", "constant"]


@overload
def constant(x: torch.Tensor) -> torch.Tensor: ...
@overload
def constant(x: None) -> None: ...
@overload
def constant(x: torch.Tensor | None) -> torch.Tensor | None: ...
def constant(x: torch.Tensor | None) -> torch.Tensor | None:
    """An input that stands for a fixed policy or a target (``old_logp``, ``ref_logp``,
    ``old_values``, ``returns``, advantages, IS weights): detached, as TRL and verl treat them,
    so no gradient flows into it even when the caller passes a tensor that requires grad (e.g.
    ``old_logp=logp`` on the first epoch). Applied once, where a public function receives it."""
    return None if x is None else x.detach()
