"""The meaning of ``mask`` and ``dones`` for the scan-based estimators, written once.

Every fast path (chunked, context parallel) builds its scans from these functions; the loop
in :mod:`rlops.advantages.reference` states the same rules as a definition, and the fused numba
kernels (:mod:`rlops.advantages._numba_kernels`) apply them token by token. Tests hold all of
them to the compacted-sequence oracle.

* A mask-0 token (tool output, observation, padding) is *skipped*: it passes every carry
  through unchanged (``x = 0``, ``a = 1``) and its outputs are 0.
* A done at token t ends a sequence there: nothing flows from t+1 into t (``a = 0``, an exact
  cut), and past the end of a sequence the value is 0 (no bootstrap).
* The value that bootstraps an action token's TD residual is the value of the *next action
  token of the same sequence*: a pass-through scan of ``V`` (exact: every step adds one value
  to 0, or multiplies by exactly 1 or 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops._checks import check_indicator, check_same_device
from rlops.scan import scan

__all__ = [
    "as_rows",
    "indicators",
    "next_action_value",
    "pass_through_decay",
    "td_residual",
    "token_decay",
]


def indicators(shape, ref: torch.Tensor, mask, dones):
    """Check the optional ``mask`` and ``dones`` of ``rewards`` ``ref``; return them as bool."""
    check_indicator("mask", mask, shape)
    check_indicator("dones", dones, shape)
    check_same_device("rewards", ref, mask=mask, dones=dones)
    mask = None if mask is None else mask.bool()
    dones = None if dones is None else dones.bool()
    return mask, dones


def as_rows(value: float | torch.Tensor, b: int, dtype, device) -> torch.Tensor:
    """A discount given as a float or a ``[B, 1]`` tensor, as a ``[B]`` tensor."""
    if isinstance(value, torch.Tensor):
        return value.reshape(b).to(dtype)
    return torch.full((b,), value, dtype=dtype, device=device)


def token_decay(discount, mask, dones, like: torch.Tensor):
    """Per-token decay: ``discount`` on action tokens, 1 (pass through) on the others, 0 where
    a sequence ends. A float or ``[B, 1]`` unchanged when neither mask nor dones is given."""
    if mask is None and dones is None:
        return discount
    a = torch.as_tensor(discount, dtype=like.dtype, device=like.device).expand_as(like)
    if mask is not None:
        a = torch.where(mask, a, 1.0)
    if dones is not None:
        a = torch.where(dones, 0.0, a)
    return a


def pass_through_decay(mask: torch.Tensor, dones: torch.Tensor | None, dtype) -> torch.Tensor:
    """Decay of the next-action-value scan: 1 on mask-0 tokens (the value of a later action
    passes through), 0 on action tokens (they hold their own value) and at dones."""
    a = ~mask if dones is None else ~mask & ~dones
    return a.to(dtype)


def next_action_value(values, mask, dones, method: str, chunk_size=None) -> torch.Tensor:
    """``V`` at the next action token of the same sequence, 0 past the last one."""
    if mask is None:
        nxt = F.pad(values[:, 1:], (0, 1))
    else:
        # z[t] = V at the first action token at or after t
        z = scan(
            torch.where(mask, values, 0.0),
            pass_through_decay(mask, dones, values.dtype),
            method,
            chunk_size,
        )
        nxt = F.pad(z[:, 1:], (0, 1))
    return nxt if dones is None else torch.where(dones, 0.0, nxt)


def td_residual(r, v, next_value, gamma, mask) -> torch.Tensor:
    """``δ = r + γ·V_next − V`` on action tokens, 0 on the others (their rewards are ignored)."""
    delta = r + gamma * next_value - v
    return delta if mask is None else torch.where(mask, delta, 0.0)
