"""Workloads measured in fresh processes (module level, so they can be pickled to a child).

Each ``setup_*`` allocates its inputs and returns the zero-argument step to measure. The inputs
are drawn on the CPU without any temporary of their size (a fresh process's memory figure is
its high-water mark above the one once the inputs exist, so a transient copy there would hide
as much of the step's peak), then moved to ``device``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlops import (
    distillation_loss,
    entropy_loss,
    linear_distillation_loss,
    linear_logprobs_and_entropy,
    linear_policy_loss,
    logprobs_and_entropy,
    policy_loss,
)
from rlops.measure.baselines import (
    logprobs_entropy_unfused,
    topk_forward_kl_chunked,
    topk_forward_kl_log_softmax,
)

__all__ = [
    "DISTILLATION_STEPS",
    "DTYPES",
    "POLICY_STEPS",
    "setup_agentic",
    "setup_distillation",
    "setup_linear",
    "setup_logits",
    "setup_policy_step",
    "top_p_keep_mask",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def top_p_keep_mask(
    logits: torch.Tensor, top_p: float, target: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``[..., V]`` bool keep mask of a top-p sampler's support, as trainers rebuild it to
    replay the sampler: sort descending, softmax (float32, or the logits' dtype if wider),
    cumulative sum, keep each token whose mass before it is below ``top_p`` (the crossing token
    included), scatter back to vocabulary order; the ``target`` (the sampled token) is kept.
    Every step is a full ``[..., V]`` tensor. No gradient."""
    with torch.no_grad():
        sorted_z, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(
            sorted_z, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)
        )
        del sorted_z
        before = probs.cumsum(dim=-1).sub_(probs)
        keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        keep.scatter_(-1, order, before < top_p)
        if target is not None:
            keep.scatter_(-1, target.unsqueeze(-1), True)
    return keep


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def setup_logits(t: int, v: int, fused: bool, device: str = "cpu") -> Callable[[], None]:
    """Float32 logits ``[t, v]``; the step: log-probs + entropy, fused (rlops) or unfused
    (``log_softmax`` + gather, softmax entropy), forward and backward with random upstream
    gradients for both outputs."""
    gen = torch.Generator().manual_seed(0)
    logits = _randn(t, v, gen=gen, dtype=torch.float32).to(device).requires_grad_()
    target = torch.randint(0, v, (t,), generator=gen).to(device)
    grads = [torch.randn(t, generator=gen).to(device), torch.randn(t, generator=gen).to(device)]
    fn = logprobs_and_entropy if fused else logprobs_entropy_unfused

    def step() -> None:
        torch.autograd.backward(list(fn(logits, target)), grads)
        logits.grad = None

    return step


def setup_linear(
    n: int,
    v: int,
    h: int,
    fused: bool,
    *,
    dtype: str = "float32",
    top_p: float | None = None,
    device: str = "cpu",
) -> Callable[[], None]:
    """Hidden ``[n, h]`` and output weight ``[v, h]`` in ``dtype``; the step: log-probs +
    entropy of ``hidden @ weight.T``, forward and backward (gradients of both inputs) with
    random upstream gradients for both outputs.

    ``fused``: ``linear_logprobs_and_entropy`` (the logits never exist whole); else the logits
    are materialised and passed to ``logprobs_and_entropy``. ``top_p``: the sampler's support
    replayed, by ``top_p=`` inside the fused op, or (materialised) by a full ``[n, v]`` keep
    mask built from the logits as a trainer does (:func:`top_p_keep_mask`).
    """
    gen = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    hidden = _randn(n, h, gen=gen, dtype=dt).to(device).requires_grad_()
    weight = _randn(v, h, gen=gen, dtype=dt, scale=h**-0.5).to(device).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen).to(device)
    grads = [torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)]

    def step() -> None:
        if fused:
            outs = linear_logprobs_and_entropy(hidden, weight, target, top_p=top_p)
        else:
            logits = hidden @ weight.T
            keep = None if top_p is None else top_p_keep_mask(logits, top_p, target)
            outs = logprobs_and_entropy(logits, target, keep_mask=keep)
        torch.autograd.backward(list(outs), grads)
        hidden.grad = weight.grad = None

    return step


def setup_agentic(
    n: int,
    v: int,
    h: int,
    form: str,
    *,
    valid: float = 0.03,
    ids: int = 20,
    device: str = "cpu",
) -> Callable[[], None]:
    """Hidden ``[n, h]`` and output weight ``[v, h]`` (float32); the step: the fused linear op's
    log-probs + entropy, forward and backward with random upstream gradients, as an agentic
    trainer calls it (``form``):

    - ``"all"``: every row; ``"mask"``: a row ``mask`` of a fraction ``valid`` of the rows (the
      model's tokens; tool output and padding cost nothing);
    - ``"dense"``: ``ids`` random kept ids per row as a full ``[n, v]`` bool ``keep_mask``,
      built in the step as a trainer builds it from the sampler's sets; ``"csr"``: the same sets
      as ``support_ids`` / ``support_offsets``.
    """
    if form not in ("all", "mask", "dense", "csr"):
        raise ValueError(f"form must be 'all', 'mask', 'dense' or 'csr', got {form!r}")
    gen = torch.Generator().manual_seed(0)
    hidden = _randn(n, h, gen=gen, dtype=torch.float32).to(device).requires_grad_()
    weight = _randn(v, h, gen=gen, dtype=torch.float32, scale=h**-0.5).to(device)
    weight.requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen).to(device)
    grads = [torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)]
    mask = (torch.rand(n, generator=gen) < valid).to(device)
    support_ids = torch.randint(0, v, (n * ids,), generator=gen).to(device)
    offsets = torch.arange(0, n * ids + 1, ids, device=device)
    rows = torch.arange(n, device=device).repeat_interleave(ids)

    def kw() -> dict:
        if form == "mask":
            return {"mask": mask}
        if form == "csr":
            return {"support_ids": support_ids, "support_offsets": offsets}
        if form == "dense":
            keep = torch.zeros(n, v, dtype=torch.bool, device=device)
            keep[rows, support_ids] = True
            return {"keep_mask": keep}
        return {}

    def step() -> None:
        outs = linear_logprobs_and_entropy(hidden, weight, target, **kw())
        torch.autograd.backward(list(outs), grads)
        hidden.grad = weight.grad = None

    return step


#: The variants of :func:`setup_policy_step`.
POLICY_STEPS = ("materialised", "fused", "one pass")


def setup_policy_step(
    n: int, v: int, h: int, variant: str, *, dtype: str = "float32", device: str = "cpu"
) -> Callable[[], None]:
    """A PPO step's loss phase from hidden states ``[8, n/8, h]`` and an output weight
    ``[v, h]`` in ``dtype``: a token-mean PPO loss plus an entropy bonus (coef 0.01), forward
    and backward (gradients of both leaves). ``variant`` (:data:`POLICY_STEPS`):
    ``"materialised"`` (``h @ W.T``, ``logprobs_and_entropy``, the losses), ``"fused"``
    (``linear_logprobs_and_entropy``, the losses: its backward makes the logits again) or
    ``"one pass"`` (``linear_policy_loss``: the gradients made in the forward)."""
    rows = 8
    gen = torch.Generator().manual_seed(0)
    dt, t = DTYPES[dtype], max(n // rows, 1)
    hidden = _randn(rows, t, h, gen=gen, dtype=dt).to(device).requires_grad_()
    weight = _randn(v, h, gen=gen, dtype=dt, scale=4 * h**-0.5).to(device).requires_grad_()
    target = torch.randint(0, v, (rows, t), generator=gen).to(device)
    old = (-torch.rand(rows, t, generator=gen) * 8).to(device)
    adv = torch.randn(rows, t, generator=gen).to(device)
    mask = (torch.rand(rows, t, generator=gen) > 0.1).to(device)

    def losses(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        loss = policy_loss(logp, old, adv, mask)[0]
        return loss + entropy_loss(ent, mask, coef=0.01)[0]

    def step() -> None:
        if variant == "materialised":
            loss = losses(*logprobs_and_entropy(hidden @ weight.T, target))
        elif variant == "fused":
            loss = losses(*linear_logprobs_and_entropy(hidden, weight, target))
        else:
            loss = linear_policy_loss(hidden, weight, target, old, adv, mask, entropy_coef=0.01)[0]
        loss.backward()
        hidden.grad = weight.grad = None

    return step


#: The variants of :func:`setup_distillation`.
DISTILLATION_STEPS = ("materialised", "verl chunked", "logits op", "linear op")


def setup_distillation(
    n: int, v: int, h: int, k: int, variant: str, *, tail: bool = False, device: str = "cpu"
) -> Callable[[], None]:
    """Top-k forward-KL distillation from hidden states ``[n, h]`` and an output weight
    ``[v, h]`` (float32), forward + backward of the token mean. ``variant``
    (:data:`DISTILLATION_STEPS`): ``"materialised"`` (``h @ W.T``, ``log_softmax``, gather,
    the divergence: verl's default path), ``"verl chunked"`` (``h @ W.T``, verl's
    ``use_chunked_topk`` path, no tail), ``"logits op"`` (``h @ W.T``, then
    ``distillation_loss``) or ``"linear op"`` (``linear_distillation_loss``: no ``[n, v]``).
    The baselines are :func:`~rlops.measure.baselines.topk_forward_kl_log_softmax` and
    :func:`~rlops.measure.baselines.topk_forward_kl_chunked`, without verl's clamp of the
    log-probs or its top-k overlap metrics."""
    if variant not in DISTILLATION_STEPS:
        raise ValueError(f"variant must be one of {DISTILLATION_STEPS}, got {variant!r}")
    if tail and variant == "verl chunked":
        raise ValueError("variant 'verl chunked' has no tail: verl's path has none (tail=False)")
    gen = torch.Generator().manual_seed(0)
    hidden = _randn(n, h, gen=gen, dtype=torch.float32).to(device).requires_grad_()
    weight = _randn(v, h, gen=gen, dtype=torch.float32, scale=4 * h**-0.5)
    weight = weight.to(device).requires_grad_()
    a, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    for r in range(0, n, 256):  # the teacher's top-k, never a [n, v] before the measurement
        top = torch.log_softmax(torch.randn(min(256, n - r), v, generator=gen) * 3, -1).topk(k, -1)
        a[r : r + 256], ids[r : r + 256] = top.values, top.indices
    a, ids = a.to(device), ids.to(device)

    def step() -> None:
        if variant == "materialised":
            loss = topk_forward_kl_log_softmax(hidden @ weight.T, a, ids, tail=tail)
        elif variant == "verl chunked":
            loss = topk_forward_kl_chunked(hidden @ weight.T, a, ids)
        elif variant == "logits op":
            loss = distillation_loss(hidden @ weight.T, a, ids, tail=tail)[0]
        else:
            loss = linear_distillation_loss(hidden, weight, a, ids, tail=tail)[0]
        loss.mean().backward()
        hidden.grad = weight.grad = None

    return step
