"""KL estimators of KL(π‖π_ref) from the log-probs of the sampled tokens, optionally
importance-sampling corrected for tokens sampled from an older policy."""

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
    """``r·k(d)``, ``r = exp(min(lp − op, 20))``, ``d = lp − rp`` (``rp``, ``op`` constants);
    k3's gradient written out; ``low_var_kl`` is ``min(r·k3, 10)``."""
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
        low_var_kl     min(k3, 10)                          (k3 clamped to [−10, 10], as verl)

    ``ref_logp`` (and ``old_logp``) stand for fixed policies: they are constants, detached
    inside, so the gradient flows into ``logp`` only, as verl and TRL treat the reference.

    A ``+`` suffix (``"k3+"``, ``"low_var_kl+"``, ...) is the straight-through variant: the value
    of the kind, the gradient of k2 (``∂/∂logp = d``; second derivative too), whose expectation
    is the gradient of KL(π‖π_ref) where k1's and k3's are not.
    Unlike verl, ``"k3"`` here is not clamped at 10 (as slime); use ``"low_var_kl"`` for that.

    **Importance-sampling correction** (``old_logp`` given; DeepSeek-V3.2's "unbiased KL
    estimate", §3.1 of https://arxiv.org/abs/2512.02556). When the tokens were sampled from
    π_old (the rollout policy) rather than π, the estimate is weighted by
    ``r = π/π_old = exp(min(logp − old_logp, 20))``::

        r·k(d)        e.g. k3: (π/π_old)·(π_ref/π − log(π_ref/π) − 1)

    and ``r`` keeps its gradient: with samples from π_old, ``E_old[r·k] = E_π[k]`` and
    ``E_old[∇(r·k)] = E_old[r·(k·∇log π + ∇k)] = ∇ E_π[k]``, so both the value and the gradient
    are unbiased (for k1 and k3, ``E_π[k] = KL(π‖π_ref)``; for the other kinds, the on-policy
    mean of that kind). A detached ratio would give k3 the gradient ``E_π[(1 − π_ref/π)∇log π]
    = ∇ KL(π_ref‖π)``, the other direction, with the weight ``π_ref/π`` that is unbounded as
    π ≪ π_ref. (``old_logp`` itself is a constant: only the ``logp`` in ``r`` carries the
    gradient.) The corrected k3's gradient is ``r·d`` per token::

        ∂/∂logp = r·k3 + r·(1 − e^(−d)) = r·d

    computed as written (the two ``r·e^(−d)`` terms of the chain rule would cancel in
    floating point), with ``r`` clamped as in the value. So where ``d < −20`` the value
    saturates but ``∂/∂logp`` stays ``r·d``, not ``r·e^20``. With ``old_logp = logp`` (or
    ``logp.detach()``) the value is the kind's own and k3's gradient is ``d``, that of
    ``"k3+"``. The straight-through ``+`` kinds are another fix of the same gradient:
    combined with ``old_logp`` they raise.

    **Clamped and corrected** (``"low_var_kl"`` with ``old_logp``): the clamp bounds the
    product, so its saturated branch is a constant::

        min(r·k3, 10)        ∂/∂logp = r·d  where r·k3 < 10,   0  where r·k3 > 10

    Where ``r·k3 < 10`` it is the corrected k3, value bit for bit. A gradient-descent step of
    size η moves logp by ``−η·r·d`` (against the sign of d, toward ``ref_logp``: ``|d|``
    becomes ``|1 − η·r|·|d| ≤ |d|`` for ``η·r ≤ 2``) or, in saturation, not at all: never away
    from the reference. Clamping the factor instead, ``r·min(k3, 10)``, estimates
    ``E_π[min(k3, 10)]`` without bias, but where ``k3 > 10`` (``d < −2.611`` or ``d > 11.000``)
    its gradient is ``∂(10·r)/∂logp = 10·r > 0`` whatever the sign of d: where π ≪ π_ref
    (``d < −2.611``) descent lowers logp further, away from the reference, the harder the
    larger r. ``min(r·k3, 10)`` is NeMo-RL's form (``calculate_kl`` in
    ``nemo_rl/algorithms/utils.py`` multiplies k3 by the importance weight, then clamps the
    product at ``kl_output_clamp_value = 10``) and slime's (``compute_approx_kl``:
    ``importance_ratio * kl``, then clamped to ``[−10, 10]``); verl's ``low_var_kl``
    (``kl_penalty_forward`` in ``verl/trainer/ppo/core_algos.py``: ``clamp(k3, −10, 10)``, no
    correction) likewise has gradient 0 in saturation, and with ``r = 1`` (``old_logp =
    logp.detach()``) this is its value. The price is a downward bias where ``r·k3 > 10``: a
    bounded estimate, as the uncorrected ``min(k3, 10)`` is.

    Args:
        logp: ``[B, T]`` (any shape) log-probs under the current policy (carries the
            gradient).
        ref_logp: log-probs under the reference policy, same shape; a constant (detached
            inside).
        kind: one of :data:`KL_KINDS`.
        old_logp: log-probs under the policy that sampled the tokens, same shape, or None
            (samples from π itself: no correction); a constant (detached inside).

    Returns:
        Tensor of ``logp``'s shape and dtype (no reduction, no mask); finite for finite inputs.

    Example:
        >>> import math, torch
        >>> logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
        >>> kl_penalty(logp, ref, "k1"), kl_penalty(logp, ref, "k3")
        (tensor([ 0.5000, -1.0000,  0.0000]), tensor([0.1065, 0.7183, 0.0000]))
        >>> old = logp - torch.tensor([0.0, 0.5, -0.5])  # r = 1, e^0.5, e^-0.5
        >>> kl_penalty(logp, ref, "k3", old_logp=old)
        tensor([0.1065, 1.1842, 0.0000])
        >>> logp, ref = torch.tensor([-4.0, -4.0, -1.0]), torch.tensor([-1.0, -1.0, -13.0])
        >>> old = logp + torch.tensor([math.log(2), 0.0, 0.0])  # d = -3, -3, 12; r = 1/2, 1, 1
        >>> kl_penalty(logp, ref, "low_var_kl", old_logp=old)  # min(r·k3, 10)
        tensor([ 8.0428, 10.0000, 10.0000])
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
