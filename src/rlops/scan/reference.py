"""The definition of the discounted reverse scan, written for clarity (a loop over time).

    y[t] = x[t] + a[t] * y[t+1],        y[T] = 0;    y[t] = x[t] where a[t] = 0

Used as the oracle in tests (in float64) and as ``method="reference"``. Not exported.
"""

from __future__ import annotations

import torch

from rlops.scan.decay import decayed, is_per_token

__all__ = ["scan_reference"]


def scan_reference(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Serial reverse scan of ``x`` ``[N, T]`` with ``decay`` a float, ``[N, 1]`` or ``[N, T]``.

    A decay of exactly 0 cuts: ``y[t] = x[t]``, whatever (even NaN) comes after."""
    n, t_len = x.shape
    per_token = is_per_token(decay, t_len)
    carry = x.new_zeros(n)
    out = []
    for t in reversed(range(t_len)):
        a_t = (
            (decay[:, t] if per_token else decay[:, 0])
            if isinstance(decay, torch.Tensor)
            else decay
        )
        carry = x[:, t] + decayed(a_t, carry)
        out.append(carry)
    if not out:
        return x.clone()
    return torch.stack(out[::-1], dim=1)
