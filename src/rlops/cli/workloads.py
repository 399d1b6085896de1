"""Workloads measured in fresh processes (module level, so they can be pickled to a child).

Each ``setup_*`` allocates its inputs and returns the zero-argument step to measure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlops import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.cli.baselines import logprobs_entropy_unfused

__all__ = ["setup_linear", "setup_logits"]


def setup_logits(t: int, v: int, fused: bool) -> Callable[[], None]:
    """Float32 logits ``[t, v]``; the step: log-probs + entropy, fused (rlops) or unfused
    (``log_softmax`` + gather, softmax entropy), forward and backward with random upstream
    gradients for both outputs."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(t, v, generator=gen).requires_grad_()
    target = torch.randint(0, v, (t,), generator=gen)
    grads = [torch.randn(t, generator=gen), torch.randn(t, generator=gen)]
    fn = logprobs_and_entropy if fused else logprobs_entropy_unfused

    def step() -> None:
        torch.autograd.backward(list(fn(logits, target)), grads)
        logits.grad = None

    return step


def setup_linear(n: int, v: int, h: int, fused: bool) -> Callable[[], None]:
    """Hidden ``[n, h]`` and output weight ``[v, h]``; the step: log-probs + entropy of
    ``hidden @ weight.T``, fused or through materialised logits, gradients of both inputs."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]

    def step() -> None:
        if fused:
            outs = linear_logprobs_and_entropy(hidden, weight, target)
        else:
            outs = logprobs_and_entropy(hidden @ weight.T, target)
        torch.autograd.backward(list(outs), grads)
        hidden.grad = weight.grad = None

    return step
