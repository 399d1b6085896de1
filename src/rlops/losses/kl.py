"""KL estimators of KL(π‖π_ref) from the log-probs of the sampled tokens."""

from __future__ import annotations

import torch

from rlops._checks import as_float_tensor, check_choice, check_same_shape, compute_dtype
from rlops.losses._common import MAX_EXP_ARG

__all__ = ["KL_KINDS", "kl_penalty"]

_KL_ALIASES = {"kl": "k1", "mse": "k2"}
_KL_BASE = ("k1", "abs", "k2", "k3", "low_var_kl")
KL_KINDS = (*_KL_BASE, *_KL_ALIASES, *(k + "+" for k in (*_KL_BASE, *_KL_ALIASES)))


def _kl_value(d: torch.Tensor, kind: str) -> torch.Tensor:
    """Estimator ``kind`` of KL(π‖π_ref) from ``d = log π − log π_ref``."""
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    # k3 = π_ref/π − 1 − log(π_ref/π) = expm1(−d) + d ≥ 0; expm1 keeps it accurate for small |d|.
    # Only the exp side is clamped: −d ≤ MAX_EXP_ARG. For large positive d, k3 → d − 1 exactly.
    dc = d.clamp_min(-MAX_EXP_ARG)
    k3 = (torch.expm1(-dc) + dc).clamp_min(0)
    return k3 if kind == "k3" else k3.clamp_max(10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from the log-probs of the sampled tokens.

    With ``d = logp − ref_logp`` (samples from π; http://joschu.net/blog/kl-approx.html)::

        k1, "kl"       d
        abs            |d|
        k2, "mse"      d² / 2
        k3             e^(−d) − 1 + d = expm1(−d) + d      (≥ 0; −d clamped to ≤ 20 before exp)
        low_var_kl     min(k3, 10)                          (k3 clamped to [−10, 10], as verl)

    A ``+`` suffix (``"k3+"``, ``"low_var_kl+"``, ...) is the straight-through variant: the value
    of the kind, the gradient of k2 (``∂/∂logp = d``, ``∂/∂ref_logp = −d``; second derivatives
    too), whose expectation is the gradient of KL(π‖π_ref) where k1's and k3's are not.
    Unlike verl, ``"k3"`` here is not clamped at 10 (as slime); use ``"low_var_kl"`` for that.

    Args:
        logp: ``[B, T]`` (any shape) log-probs under the current policy.
        ref_logp: log-probs under the reference policy, same shape.
        kind: one of :data:`KL_KINDS`.

    Returns:
        Tensor of ``logp``'s shape and dtype (no reduction, no mask); finite for finite inputs.

    Example:
        >>> import torch
        >>> logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
        >>> kl_penalty(logp, ref, "k1"), kl_penalty(logp, ref, "k3")
        (tensor([ 0.5000, -1.0000,  0.0000]), tensor([0.1065, 0.7183, 0.0000]))
    """
    as_float_tensor("logp", logp)
    check_same_shape("logp", logp, ref_logp=ref_logp)
    check_choice("kind", kind, KL_KINDS)
    straight_through = kind.endswith("+")
    base = kind.rstrip("+")
    base = _KL_ALIASES.get(base, base)
    dtype = compute_dtype(logp.dtype)
    d = logp.to(dtype) - ref_logp.to(dtype)
    if straight_through:
        # Value 0·(2d) = 0 added to the kind's value; first and second derivatives are k2's
        # (d and 1). Unlike k2 − k2.detach(), it does not square d, so it cannot overflow.
        dd = d.detach()
        out = _kl_value(dd, base) + 0.5 * (d - dd) * (d + dd)
    else:
        out = _kl_value(d, base)
    if dtype != logp.dtype:
        big = torch.finfo(logp.dtype).max
        out = out.clamp(-big, big)
    return out.to(logp.dtype)


