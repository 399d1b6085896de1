"""The output layer, log-probs, entropy bonus and policy loss of a step in one pass over the
vocabulary, the gradients made in the forward (docs/design/losses.md: one pass)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import (
    as_bool_mask,
    as_real,
    check_2d,
    check_bool,
    check_choice,
    check_same_shape,
    is_finite,
)
from rlops.distributed.rows import Rows
from rlops.logprobs.linear import linear_logprobs_and_entropy, linear_logprobs_one_pass
from rlops.losses._checks import check_options
from rlops.losses.aggregation import AGGREGATION_KEYS, aggregate_loss
from rlops.losses.entropy import entropy_loss
from rlops.losses.kinds import POLICY_KINDS, token_losses
from rlops.losses.policy import PolicyLossOptions, policy_loss

__all__ = ["ONE_PASS_KINDS", "linear_policy_loss"]

#: The kinds whose per-token loss depends on its own token alone: one pass over the vocabulary
#: (``cispo`` and ``sapo`` with ``level="token"``). The others read a row's or the batch's
#: log-probs (a sequence ratio, a covariance selection) and take the composition's recompute.
ONE_PASS_KINDS = ("ppo", "reinforce", "cispo", "sapo", "dppo_tv", "dppo_kl", "dro", "ipo", "topr")
# the log-prob op's keywords set by linear_policy_loss itself
_OWN = frozenset({"bias", "temperature", "with_entropy", "with_sum_pi_squared", "mask"})


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    entropy_coef: float = 0.0,
    kind: str = "ppo",
    agg: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    logprob_options: Mapping[str, Any] | None = None,
    one_pass: bool | None = None,
    return_logprobs: bool = False,
    **options: Unpack[PolicyLossOptions],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss plus entropy bonus straight from the hidden states, in one pass over the
    vocabulary: the value, gradients and metrics of ::

        logp, H = linear_logprobs_and_entropy(hidden, weight, target, bias=bias,
                                              temperature=temperature, **logprob_options)
        loss, metrics = policy_loss(logp, old_logp, advantages, mask, kind=kind, agg=agg, ...)
        loss = loss + entropy_loss(H, mask, coef=entropy_coef, agg=agg)[0]

    For a kind of :data:`ONE_PASS_KINDS` in one process, each chunk of rows makes its logits
    ``z = (h·Wᵀ + b)/τ`` once: its ``log p_y`` and ``H``, then the loss's per-token gradients
    ``g_t = w_t·∂ℓ_t/∂log p_t`` and ``−coef·w_t`` (``w_t = ∂agg/∂ℓ_t``, known from the mask and
    the normalisers before the pass), then ``∂L/∂z`` and the chunk's share of the hidden,
    weight and bias gradients: three ``N×H×V`` matmuls where the composition takes four (its
    backward makes the logits again), all in the forward; the backward scales them. Other
    kinds, ``group`` in ``logprob_options`` (tensor parallelism) and ``torch.compile`` (no
    graph of a loss's per-chunk autograd) run the composition.

    Args:
        hidden: ``[B, T, H]`` hidden states; ``weight`` ``[V, H]``; ``bias`` ``[V]`` or None.
        target, old_logp, advantages, mask: ``[B, T]``: sampled ids, constants, 0/1 mask;
            ``old_logp`` None: on-policy, the detached log-probs themselves (ratio 1).
        temperature: as :func:`linear_logprobs_and_entropy` (a float or per-row tensor).
        entropy_coef: the entropy bonus' coefficient (0: none).
        kind, agg, rollout_is_weights, **options: as :func:`policy_loss` (``agg`` not None;
            its aggregation options also aggregate the entropy).
        logprob_options: the log-prob op's other keywords (``top_k``, ``top_p``, ``min_p``,
            ``final_logit_softcapping``, ``logit_scale``, ``logits_dtype``, ``chunk_size``,
            ``group``, ...).
        one_pass: None: one pass where the kind allows it; True: demand it (a ``ValueError``
            naming the kind otherwise); False: the composition.
        return_logprobs: also put the detached ``[B, T]`` log-probs and entropies in
            ``metrics`` under ``"logp"`` and ``"entropy"`` (what the metrics of a caller's
            own, e.g. clip fractions, are made of).

    Returns:
        ``(loss, metrics)``: the 0-dim loss and :func:`policy_loss`'s metrics.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w = torch.randn(2, 3, 8, generator=g), torch.randn(11, 8, generator=g)
        >>> y, old = torch.randint(0, 11, (2, 3), generator=g), -torch.rand(2, 3, generator=g)
        >>> adv, m = torch.randn(2, 3, generator=g), torch.ones(2, 3)
        >>> loss, metrics = linear_policy_loss(h, w, y, old, adv, m, entropy_coef=0.01)
        >>> logp, ent = linear_logprobs_and_entropy(h, w, y)
        >>> composed = policy_loss(logp, old, adv, m)[0] + entropy_loss(ent, m, coef=0.01)[0]
        >>> bool(torch.isclose(loss, composed))
        True
    """
    lp_options = _logprob_options(logprob_options)
    ref_name, ref = ("advantages", advantages) if old_logp is None else ("old_logp", old_logp)
    check_2d(ref_name, ref)
    if old_logp is not None:
        check_same_shape("old_logp", old_logp, advantages=advantages)
    if not isinstance(target, torch.Tensor) or target.shape != ref.shape:
        shape = getattr(target, "shape", type(target).__name__)
        raise ValueError(f"target must be [B, T] like {ref_name} {tuple(ref.shape)}, got {shape}")
    check_bool("return_logprobs", return_logprobs)
    check_choice("kind", kind, POLICY_KINDS)
    if agg is None:
        raise ValueError("agg=None is not a loss: linear_policy_loss needs an aggregation mode")
    coef_read = not isinstance(entropy_coef, torch.Tensor)  # a device tensor is not read
    if coef_read and not is_finite(as_real("entropy_coef", entropy_coef)):
        raise ValueError(f"entropy_coef must be a finite number, got {entropy_coef}")
    if one_pass is not None:
        check_bool("one_pass", one_pass)
    local = kind in ONE_PASS_KINDS and options.get("level", "token") == "token"
    if one_pass and not local:
        raise ValueError(
            f"linear_policy_loss(kind={kind!r}, one_pass=True): this kind reads a row's or the "
            f"batch's log-probs, so its gradient is not known per chunk; one pass: "
            f"{ONE_PASS_KINDS} (cispo / sapo with level='token')"
        )
    if one_pass and lp_options.get("group") is not None:
        raise ValueError(
            "linear_policy_loss(one_pass=True) runs in one process: with logprob_options' "
            "group (tensor parallelism) a row's normaliser needs the group's statistics first"
        )
    composed = one_pass is False or not local or lp_options.get("group") is not None
    # traced, the loss's per-chunk autograd has no graph form: the composition (the same value)
    composed = composed or torch.compiler.is_compiling()
    head = {"bias": bias, "temperature": temperature, **lp_options}
    loss_kw: dict[str, Any] = {"kind": kind, "agg": agg, "rollout_is_weights": rollout_is_weights}
    if composed:
        logp, ent = linear_logprobs_and_entropy(hidden, weight, target, **head)
        old = logp.detach() if old_logp is None else old_logp
        loss, metrics = policy_loss(logp, old, advantages, mask, **loss_kw, **options)
        loss = _with_entropy(loss, ent, mask, entropy_coef, agg, options)
    else:
        token_grad = _TokenGrad(
            target, old_logp, advantages, mask, kind, agg, rollout_is_weights, entropy_coef,
            options,
        )  # fmt: skip
        logp, ent, *grads = linear_logprobs_one_pass(
            hidden.detach(), weight.detach(), target, token_grad, **head
        )
        logp, ent = logp.view(target.shape), None if ent is None else ent.view(target.shape)
        old = logp if old_logp is None else old_logp
        loss, metrics = policy_loss(logp, old, advantages, mask, **loss_kw, **options)
        loss = _with_entropy(loss, ent, mask, entropy_coef, agg, options).detach()
        loss = _Attached.apply(loss, hidden, weight, bias, *grads)
    if return_logprobs:
        assert ent is not None  # linear_policy_loss always computes the entropy
        metrics = {**metrics, "logp": logp.detach(), "entropy": ent.detach()}
    return loss, metrics


def _logprob_options(given: Mapping[str, Any] | None) -> dict[str, Any]:
    """``logprob_options`` as a dict, without the keywords this function sets itself."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(f"logprob_options must be a mapping or None, got {type(given).__name__}")
    own = sorted(_OWN & set(given))
    if own:
        raise TypeError(
            f"logprob_options must not set {own}: linear_policy_loss takes bias and temperature "
            "itself, always computes the entropy, and its mask is the loss's"
        )
    return dict(given)


def _with_entropy(
    loss: torch.Tensor,
    ent: torch.Tensor | None,
    mask: torch.Tensor,
    coef: float,
    agg: str,
    options: Mapping[str, Any],
) -> torch.Tensor:
    """``loss`` plus the entropy bonus (nothing added when ``coef`` is 0)."""
    if ent is None or (not isinstance(coef, torch.Tensor) and coef == 0):
        return loss
    aggregation = {k: v for k, v in options.items() if k in AGGREGATION_KEYS}
    bonus = entropy_loss(ent.view(mask.shape), mask, agg=agg, coef=coef, **aggregation)[0]
    return loss + bonus.to(loss.dtype)


class _TokenGrad:
    """The loss's per-token gradients for a chunk (:data:`rlops.logprobs.linear.TokenGrad`):
    ``w_t·∂ℓ_t/∂log p_t`` by autograd on the kind's own per-token loss, and ``−coef·w_t``."""

    def __init__(self, target, old_logp, advantages, mask, kind, agg, is_weights, coef, options):
        name, ref = ("advantages", advantages) if old_logp is None else ("old_logp", old_logp)
        keep = as_bool_mask("mask", mask, ref.shape, name, ref)
        self.keep, self.kind = keep.reshape(-1), kind
        # None: on-policy, the ratio's denominator is the chunk's own detached log-probs
        self.old = None if old_logp is None else old_logp.detach().reshape(-1)
        self.adv = advantages.detach().reshape(-1)
        self.is_w = None if is_weights is None else is_weights.detach().reshape(-1)
        self.kind_options = check_options(kind, {k: v for k, v in options.items()
                                                 if k not in AGGREGATION_KEYS})  # fmt: skip
        aggregation = {k: v for k, v in options.items() if k in AGGREGATION_KEYS}
        self.w = _weights(keep, agg, aggregation).reshape(-1)
        self.coef = coef

    def __call__(self, index, lp, ent):
        keep = self.keep.index_select(0, index)
        w = self.w.index_select(0, index).to(lp.dtype)
        with torch.enable_grad():
            x = lp.detach().requires_grad_()
            old = lp.detach() if self.old is None else self.old.index_select(0, index).to(lp.dtype)
            lpk = torch.where(keep, x, 0)
            lr = torch.where(keep, x - old, 0)
            adv = torch.where(keep, self.adv.index_select(0, index).to(lp.dtype), 0)
            rows = Rows(keep.unsqueeze(0), lp.dtype)
            loss_mat, _ = token_losses(
                self.kind, lpk.unsqueeze(0), lr.unsqueeze(0), adv.unsqueeze(0), rows,
                self.kind_options,
            )  # fmt: skip
            loss_mat = loss_mat[0]
            if self.is_w is not None:
                loss_mat = loss_mat * torch.where(keep, self.is_w.index_select(0, index), 0)
            (g,) = torch.autograd.grad((loss_mat * w).sum(), x)
        no_bonus = not isinstance(self.coef, torch.Tensor) and self.coef == 0
        g_ent = None if ent is None or no_bonus else -self.coef * w
        return g, g_ent


def _weights(keep: torch.Tensor, agg: str, options: Mapping[str, Any]) -> torch.Tensor:
    """``w = ∂ aggregate_loss(ℓ) / ∂ℓ`` ``[B, T]``: the aggregation is linear in ``ℓ``, so its
    weights come from one call on zeros (the normalisers from the mask and ``options``)."""
    with torch.enable_grad():
        dtype = torch.float32 if keep.device.type == "mps" else torch.float64  # MPS: no float64
        x = torch.zeros(keep.shape, dtype=dtype, device=keep.device, requires_grad=True)
        (w,) = torch.autograd.grad(aggregate_loss(x, keep, agg, **options), x)
    return w


class _Attached(torch.autograd.Function):
    """The loss's value with the gradients made in the forward: the backward scales them."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grad_h, grad_w, grad_b):
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]

        def scaled(t, need):
            return None if t is None or not need else t * g.to(t.dtype)

        return None, scaled(grad_h, need_h), scaled(grad_w, need_w), scaled(grad_b, need_b), \
            None, None, None  # fmt: skip
