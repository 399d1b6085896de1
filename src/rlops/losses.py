"""PPO-family losses on ``[B, T]`` token tensors: KL estimators, policy and value losses, and the
aggregation of a per-token loss matrix into a scalar.

Numerical rules:

* Every argument of ``exp`` is clamped to at most ``MAX_EXP_ARG = 20`` (``e^20 ≈ 4.9e8``, finite
  in float32 and bfloat16). Outside the clamp the value saturates and its gradient is 0.
* Half-precision inputs are computed in float32. Scalar losses and metrics are returned in the
  computation dtype (float32 for half inputs, as under autocast); per-token KL values are
  returned in the input dtype, saturated to its finite range (float16 cannot hold ``e^20``).
* Entries with mask 0 are replaced with ``torch.where`` before any arithmetic, so NaN/inf there
  (padding) reaches neither the loss nor any gradient: their gradient is exactly 0.
* Nothing reads a value back to the host; metrics are detached 0-dim tensors.
"""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_bool_mask,
    as_float_tensor,
    check_2d,
    check_choice,
    check_positive,
    check_same_shape,
    compute_dtype,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "MAX_EXP_ARG",
    "aggregate_loss",
    "kl_penalty",
    "policy_loss",
    "value_loss",
]

MAX_EXP_ARG = 20.0
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL_ALIASES = {"kl": "k1", "mse": "k2"}
_KL_BASE = ("k1", "abs", "k2", "k3", "low_var_kl")
KL_KINDS = (*_KL_BASE, *_KL_ALIASES, *(k + "+" for k in (*_KL_BASE, *_KL_ALIASES)))


# --------------------------------------------------------------------------- helpers
def _masked_frac(flag: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fraction of mask-1 tokens where ``flag`` holds (0 when there are none); detached."""
    hits = (flag & keep).sum().to(dtype)
    return (hits / keep.sum().to(dtype).clamp_min(1)).detach()


# --------------------------------------------------------------------------- aggregation
def _aggregate(
    x: torch.Tensor, keep: torch.Tensor, mode: str | None, loss_scale_factor: float | None
) -> torch.Tensor:
    """``mode`` reduction of ``x``, which must already be 0 where ``keep`` is False;
    ``mode=None`` returns ``x`` itself (the per-token matrix)."""
    if mode is None:
        return x
    if mode == "token-mean":
        return x.sum() / keep.sum().to(x.dtype).clamp_min(1)
    tokens = keep.sum(-1).to(x.dtype)
    seq = x.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp_min(1)
    out = seq.sum() / (tokens > 0).sum().to(x.dtype).clamp_min(1)
    if mode == "seq-mean-token-sum-norm":
        out = out / (x.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def _check_agg(name: str, mode: object, loss_scale_factor: object) -> float | None:
    """Check an aggregation mode (or None) and its normaliser; return the normaliser."""
    if mode is not None:
        check_choice(name, mode, AGG_MODES)
    if loss_scale_factor is None:
        return None
    return check_positive("loss_scale_factor", loss_scale_factor)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar, with verl's ``loss_agg_mode`` names.

    With ``m`` the mask, ``n_b = Σ_t m[b,t]`` and ``B'`` the number of rows with ``n_b > 0``::

        token-mean               Σ_{b,t} m·ℓ / Σ_{b,t} m
        seq-mean-token-sum       (1/B') Σ_b Σ_t m·ℓ
        seq-mean-token-mean      (1/B') Σ_b (Σ_t m·ℓ) / n_b
        seq-mean-token-sum-norm  (1/B') Σ_b Σ_t m·ℓ / L      (Dr.GRPO; L = loss_scale_factor or T)

    ``seq-mean-token-sum-norm`` is Dr.GRPO's objective (https://arxiv.org/abs/2503.20783):
    the mean over sequences of each sequence's token *sum*, divided by a constant ``L`` instead
    of each sequence's own length. This is verl's definition since February 2026 (its
    ``agg_loss`` shares the ``seq-mean-token-sum`` branch and then divides by
    ``loss_scale_factor``); earlier verl releases divided the plain token sum by ``L`` without
    the mean over sequences (``B'`` times larger). ``L`` defaults to ``T`` and should be a fixed
    maximum response length when ``T`` varies between micro-batches. Rows with no action token
    are left out of the sequence means (as current verl); an empty batch gives 0.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` 0/1 action mask.
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: ``L`` for ``seq-mean-token-sum-norm`` (``> 0``); ignored otherwise.

    Returns:
        0-dim tensor, float32 for half inputs, else ``loss_mat``'s dtype. Differentiable.

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate_loss(loss, m, mode).item(), 4) for mode in AGG_MODES]
        [2.5, 5.0, 3.0, 1.6667]
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("mask", mask, loss_mat.shape, "loss_mat", loss_mat)
    if mode is None:
        raise ValueError(f"mode must be one of {list(AGG_MODES)}, got None")
    loss_scale_factor = _check_agg("mode", mode, loss_scale_factor)
    x = torch.where(keep, loss_mat.to(compute_dtype(loss_mat.dtype)), 0)
    return _aggregate(x, keep, mode, loss_scale_factor)


# --------------------------------------------------------------------------- KL estimators
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


# --------------------------------------------------------------------------- policy loss
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str | None = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip ("clip-higher") and optional dual-clip.

    With ``ρ = exp(min(logp − old_logp, 20))`` and advantage ``A``, per token::

        ℓ = max(−A·ρ, −A·clip(ρ, 1 − clip_low, 1 + clip_high))           (PPO)
        ℓ = min(ℓ, −A·c)   where A < 0, if dual_clip = c > 1                (dual-clip)

    then ``loss = aggregate_loss(ℓ, mask, agg)``. ``clip_high=None`` means ``clip_low``; an
    infinite clip gives the unclipped surrogate ``−A·ρ``. Dual-clip bounds the loss of a
    negative-advantage token by ``c·|A|`` however large ρ grows.
    PPO: https://arxiv.org/abs/1707.06347 — dual-clip: https://arxiv.org/abs/1912.09729 —
    clip-higher: https://arxiv.org/abs/2503.14476

    Args:
        logp: ``[B, T]`` log-probs under the policy being trained (carries the gradient).
        old_logp: ``[B, T]`` log-probs under the policy that sampled the tokens.
        advantages: ``[B, T]``.
        mask: ``[B, T]`` 0/1 action mask.
        clip_low, clip_high: ``clip_low`` in (0, 1), ``clip_high > 0``; ``inf`` turns that side
            of the clip off. Numbers, numpy scalars or 0-dim tensors.
        dual_clip: ``None`` (off) or ``c > 1``.
        agg: aggregation mode, see :func:`aggregate_loss`; ``None`` returns the per-token loss
            matrix ``[B, T]`` (0 on mask-0 tokens) instead of a scalar, for callers that
            aggregate themselves.
        loss_scale_factor: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32 for half inputs; ``[B, T]`` with
        ``agg=None``) and detached 0-dim tensors
        ``pg_clipfrac`` (fraction of action tokens where the clipped term is the larger),
        ``ppo_kl`` (mean of ``old_logp − logp`` over action tokens, unclamped) and
        ``pg_clipfrac_lower`` (fraction where dual-clip binds; 0 when off) — verl's names.

    Example:
        >>> import torch
        >>> logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> loss, m = policy_loss(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
        >>> round(loss.item(), 4), round(m["pg_clipfrac"].item(), 4)
        (-0.4667, 0.6667)
    """
    check_2d("logp", logp)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages)
    keep = as_bool_mask("mask", mask, logp.shape, "logp", logp)
    clip_low = check_positive("clip_low", clip_low)
    if 1 <= clip_low < math.inf:
        raise ValueError(
            "clip_low must be < 1 (the ratio floor 1 - clip_low must stay positive) or inf "
            f"(no lower clip), got {clip_low}"
        )
    clip_high = clip_low if clip_high is None else check_positive("clip_high", clip_high)
    if dual_clip is not None:
        dual_clip = check_positive("dual_clip", dual_clip, above=1.0)
    loss_scale_factor = _check_agg("agg", agg, loss_scale_factor)

    dtype = compute_dtype(logp.dtype)
    # Mask-0 entries are replaced before any arithmetic, so their gradient is exactly 0.
    log_ratio = torch.where(keep, logp.to(dtype) - old_logp.to(dtype), 0)
    adv = torch.where(keep, advantages.to(dtype), 0)
    ratio = torch.exp(log_ratio.clamp_max(MAX_EXP_ARG))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": _masked_frac(clipped > unclipped, keep, dtype),
        "ppo_kl": _aggregate(-log_ratio.detach(), keep, "token-mean", None),
    }
    if dual_clip is not None:
        bound = -adv * dual_clip
        lower = (adv < 0) & (loss_mat > bound)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, bound), loss_mat)
        metrics["pg_clipfrac_lower"] = _masked_frac(lower, keep, dtype)
    else:
        metrics["pg_clipfrac_lower"] = torch.zeros((), dtype=dtype, device=logp.device)
    return _aggregate(loss_mat, keep, agg, loss_scale_factor), metrics


# --------------------------------------------------------------------------- value loss
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    agg: str | None = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5·agg(max((V − R)², (V_clip − R)²))``.

    ``V_clip = clamp(V, V_old − clip, V_old + clip)`` keeps the new value within ``clip`` of the
    value at sampling time; ``clip=None`` gives the plain ``0.5·agg((V − R)²)``.

    Args:
        values: ``[B, T]`` value predictions being trained (``vpreds``).
        old_values: ``[B, T]`` value predictions at sampling time.
        returns: ``[B, T]`` regression targets.
        mask: ``[B, T]`` 0/1 action mask.
        clip: ``None`` or ``> 0`` (verl's ``cliprange_value``).
        agg: aggregation mode, see :func:`aggregate_loss`; ``None`` returns the per-token loss
            matrix ``[B, T]`` (0 on mask-0 tokens) instead of a scalar, for callers that
            aggregate themselves.
        loss_scale_factor: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32 for half inputs; the ``[B, T]`` matrix
        ``0.5·max(...)`` with ``agg=None``) and ``vf_clipfrac``, the
        detached fraction of action tokens where the clipped error is the larger (0 when off).

    Example:
        >>> import torch
        >>> v, old, ret = torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2)
        >>> loss, m = value_loss(v, old, ret, torch.ones(1, 2), clip=0.5)
        >>> loss.item(), m["vf_clipfrac"].item()
        (2.5, 0.0)
    """
    check_2d("values", values)
    check_same_shape("values", values, old_values=old_values, returns=returns)
    keep = as_bool_mask("mask", mask, values.shape, "values", values)
    if clip is not None:
        clip = check_positive("clip", clip)
    loss_scale_factor = _check_agg("agg", agg, loss_scale_factor)

    dtype = compute_dtype(values.dtype)
    v, ret = (torch.where(keep, x.to(dtype), 0) for x in (values, returns))
    loss_mat = (v - ret).square()
    if clip is None:
        clipfrac = torch.zeros((), dtype=dtype, device=values.device)
    else:
        old = torch.where(keep, old_values.to(dtype), 0)
        clipped = (torch.clamp(v, old - clip, old + clip) - ret).square()
        clipfrac = _masked_frac(clipped > loss_mat, keep, dtype)
        loss_mat = torch.maximum(loss_mat, clipped)
    return 0.5 * _aggregate(loss_mat, keep, agg, loss_scale_factor), {"vf_clipfrac": clipfrac}
