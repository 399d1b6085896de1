"""Numbers and rules shared by the loss modules (private to the package)."""

from __future__ import annotations

from typing import overload

import torch

from rlops._numerics import MAX_EXP_ARG as MAX_EXP_ARG


@overload
def constant(x: torch.Tensor) -> torch.Tensor: ...
@overload
def constant(x: None) -> None: ...
@overload
def constant(x: torch.Tensor | None) -> torch.Tensor | None: ...
def constant(x: torch.Tensor | None) -> torch.Tensor | None:
    """A fixed policy or target, detached once where a public function receives it."""
    return None if x is None else x.detach()
