"""Per-token estimators of KL(π‖π_ref), optionally importance-sampling corrected."""

from __future__ import annotations

import torch

from rlops._checks import as_float_tensor, check_choice, check_same_shape, compute_dtype
from rlops.losses._common import MAX_EXP_ARG, constant

__all__ = ["KL_KINDS", "kl_penalty"]

_KL_ALIASES = {"kl": "k1", "mse": "k2"}
_KL_BASE = ("k1", "abs", "k2", "k3", "low_var_kl")
KL_KINDS = (*_KL_BASE, *_KL_ALIASES, *(k + "+" for k in (*_KL_BASE, *_KL_ALIASES)))
# low_var_kl's bound (verl's clamp of k3; NeMo-RL's kl_output_clamp_value).
LOW_VAR_KL_MAX = 10.0


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
    return k3 if kind == "k3" else k3.clamp_max(LOW_VAR_KL_MAX)


def _is_corrected(lp: torch.Tensor, d: torch.Tensor, op: torch.Tensor, kind: str) -> torch.Tensor:
    """``r·k(d)``, ``r = exp(min(lp − op, 20))``; k3's gradient written out."""
    base = "k3" if kind == "low_var_kl" else kind
    r = torch.exp((lp - op).clamp_max(MAX_EXP_ARG))
    value = r * _kl_value(d, base)
    if base == "k3" and value.requires_grad:
        # The chain rule gives ∂/∂lp = r·k3 + r·(1 − e^(−d)): two terms of size r·e^(−d)
        # that cancel to r·d, a relative error of ~eps·e^(−d)/|d| (2% at d = −15 in float32),
        # and past the clamp on −d the first term stays r·e^20. So the value is r·k3 and the
        # gradient is the formula's, r·d, computed directly: ½(lp − sg lp)(g + sg g) has
        # value 0, first derivative g and second derivative that of g.
        g = r * d
        value = value.detach() + 0.5 * (lp - lp.detach()) * (g + g.detach())
    # low_var_kl clamps the product: where r·k3 > 10 the value is 10 and the gradient 0 (the
    # clamp's), elsewhere both are the corrected k3's (r·k3 and r·d, bit for bit).
    return value.clamp_max(LOW_VAR_KL_MAX) if kind == "low_var_kl" else value


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str,
    *,
    old_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from the log-probs of the sampled tokens.

    With ``d = logp − ref_logp`` (samples from π; http://joschu.net/blog/kl-approx.html)::

        k1, "kl"       d
        abs            |d|
        k2, "mse"      d² / 2
        k3             e^(−d) − 1 + d = expm1(−d) + d      (≥ 0; −d clamped to ≤ 20 before exp)
        low_var_kl     min(k3, 10)                          (verl's clamp of k3)
        kind + "+"     the kind's value, k2's gradient d (straight-through)

    With ``old_logp`` (samples from π_old; https://arxiv.org/abs/2512.02556 §3.1) it is ``r·k(d)``,
    ``r = exp(min(logp − old_logp, 20))`` with its gradient; ``low_var_kl``: ``min(r·k3, 10)``.

    Args:
        logp: log-probs under the current policy, any shape (``[B, T]``).
        ref_logp, old_logp: the reference's and (or None) the sampler's, constants (detached).
        kind: one of :data:`KL_KINDS`.

    Returns:
        Tensor of ``logp``'s shape and dtype (no reduction, no mask).

    Example:
        >>> import torch
        >>> logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
        >>> kl_penalty(logp, ref, "k1"), kl_penalty(logp, ref, "k3")
        (tensor([ 0.5000, -1.0000,  0.0000]), tensor([0.1065, 0.7183, 0.0000]))
        >>> old = logp - torch.tensor([0.0, 0.5, -0.5])  # r = 1, e^0.5, e^-0.5
        >>> kl_penalty(logp, ref, "k3", old_logp=old)
        tensor([0.1065, 1.1842, 0.0000])
    """
    as_float_tensor("logp", logp)
    check_same_shape("logp", logp, ref_logp=ref_logp)
    check_choice("kind", kind, KL_KINDS)
    straight_through = kind.endswith("+")
    base = kind.rstrip("+")
    base = _KL_ALIASES.get(base, base)
    if old_logp is not None:
        check_same_shape("logp", logp, old_logp=old_logp)
        if straight_through:
            raise ValueError(
                f"old_logp (the importance-sampling correction) cannot be combined with the "
                f"straight-through kind {kind!r}: both correct the estimator's gradient; "
                f"use {base!r}"
            )
    # The reference and sampling policies are constants: no gradient into them.
    ref_logp, old_logp = constant(ref_logp), constant(old_logp)
    dtype = compute_dtype(logp.dtype)
    lp = logp.to(dtype)
    d = lp - ref_logp.to(dtype)
    if old_logp is not None:
        out = _is_corrected(lp, d, old_logp.to(dtype), base)
    elif straight_through:
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
