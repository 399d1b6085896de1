"""The workloads the benchmarks measure: the trainer's top-p keep mask is the sampler support
rlops rebuilds, and every output-layer variant computes the same log-probs and gradients."""

from __future__ import annotations

import pytest
import torch

from rlops import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.measure import workloads


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_keep_mask_replays_the_top_p_support(top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 300, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, 300, (40,), generator=gen)
    keep = workloads.top_p_keep_mask(logits, top_p, target)
    assert keep.dtype == torch.bool and keep.shape == logits.shape
    assert keep.gather(-1, target[:, None]).all()
    if top_p == 1.0:
        assert keep.all()
    replayed = logprobs_and_entropy(logits, target, keep_mask=keep)
    rebuilt = logprobs_and_entropy(logits, target, top_p=top_p)
    for a, b in zip(replayed, rebuilt):
        torch.testing.assert_close(a, b)


def test_keep_mask_is_the_smallest_prefix_reaching_p():
    logits = torch.tensor([[3.0, 0.0, 2.0, 1.0]]).log()  # probabilities 0.5, 0, 1/3, 1/6
    for p, expected in ((0.5, [1, 0, 0, 0]), (0.6, [1, 0, 1, 0]), (0.9, [1, 0, 1, 1])):
        assert workloads.top_p_keep_mask(logits, p).int().tolist() == [expected]


def test_output_layer_variants_agree():
    """Materialised + fused, fused linear, and with a top-p support the keep mask and the
    fused op, give the same values and gradients (float64)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 8, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(200, 8, generator=gen, dtype=torch.float64).requires_grad_()
    target = torch.randint(0, 200, (30,), generator=gen)
    upstream = torch.randn(2, 30, generator=gen, dtype=torch.float64)

    def run(fn):
        outs = fn()
        grads = torch.autograd.grad(outs, (hidden, weight), list(upstream))
        return [o.detach() for o in outs], grads

    for top_p in (None, 0.7):

        def materialised(top_p=top_p):
            logits = hidden @ weight.T
            keep = None if top_p is None else workloads.top_p_keep_mask(logits, top_p, target)
            return logprobs_and_entropy(logits, target, keep_mask=keep)

        ours = run(lambda top_p=top_p: linear_logprobs_and_entropy(hidden, weight, target,
                                                                   top_p=top_p))  # fmt: skip
        for a, b in zip(run(materialised), ours):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_setup_linear_steps_run(dtype, fused, top_p):
    step = workloads.setup_linear(16, 64, 8, fused, dtype=dtype, top_p=top_p)
    step()
    step()
    step = workloads.setup_logits(16, 64, fused)
    step()
