"""``mask=`` with ``method="triton"`` (the kernels under the interpreter): the outputs and the
gradient equal the chunked method's, exact zeros on the masked rows, whatever those logits hold.
"""

from __future__ import annotations

import pytest
import torch
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

from rlops.logprobs import logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize(
    "kw", [{}, {"keep_mask": True, "with_sum_pi_squared": True}, {"top_p": 0.8, "temperature": 0.7}]
)
def test_triton_with_a_mask_equals_the_chunked_method(kw):
    g = torch.Generator().manual_seed(0)
    n, v = 37, 300
    logits = torch.randn(n, v, generator=g) * 3
    target = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.3
    logits[~mask] = float("nan")  # masked rows may hold anything
    kw = dict(kw)
    if kw.get("keep_mask") is True:
        kw["keep_mask"] = torch.rand(n, v, generator=g) < 0.5
    grads = [torch.randn(n, generator=g) for _ in range(2)]
    res = []
    for method in ("triton", "chunked"):
        x = logits.clone().requires_grad_()
        outs = logprobs_and_entropy(x, target, mask=mask, method=method, **kw)
        torch.autograd.backward(list(outs[:2]), grads)
        res.append(([o.detach() for o in outs], x.grad))
    (a, ga), (b, gb) = res
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q)
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask]))
    torch.testing.assert_close(ga, gb)
    assert torch.equal(ga[~mask], torch.zeros_like(ga[~mask]))


def _masked_vs_unmasked(n, v, mask, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    target = torch.randint(0, v, (n,), generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(2)]
    kw = dict(kw)
    if kw.get("keep_mask") is True:
        kw["keep_mask"] = torch.rand(n, v, generator=g) < 0.5
    res = []
    for m in (mask, None):
        x = logits.clone()
        if m is not None:
            x[~m] = float("nan")  # never read: the masked rows' programs return at once
        x.requires_grad_()
        outs = logprobs_and_entropy(x, target, mask=m, method="triton", **kw)
        torch.autograd.backward(list(outs[:2]), grads)
        res.append(([o.detach() for o in outs], x.grad))
    return res


@pytest.mark.parametrize("n", [1, 127, 129])
@pytest.mark.parametrize("which", ["random", "all masked", "none masked"])
@pytest.mark.parametrize(
    "kw", [{}, {"keep_mask": True, "with_sum_pi_squared": True, "temperature": 0.7}]
)
def test_masked_rows_are_zero_and_the_others_as_without_a_mask(n, which, kw):
    """On the valid rows, the bits of the call without a mask (a row's result depends on its
    own logits only); elsewhere exact zeros, for the outputs and the gradient."""
    g = torch.Generator().manual_seed(n)
    mask = {
        "random": torch.rand(n, generator=g) < 0.5,
        "all masked": torch.zeros(n, dtype=torch.bool),
        "none masked": torch.ones(n, dtype=torch.bool),
    }[which]
    (a, ga), (b, gb) = _masked_vs_unmasked(n, 300, mask, **kw)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p[mask], q[mask])
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask]))
    assert torch.equal(ga[mask], gb[mask])
    assert torch.equal(ga[~mask], torch.zeros_like(ga[~mask]))


@pytest.mark.parametrize("block_n", [1, 4])
def test_kernels_write_an_empty_row_for_masked_rows(block_n):
    """The kernels themselves: a masked row's statistics are those of an empty row of
    log-prob 0 (z_y = m = 0, s = 1, h = 0, ρ = 0) and its gradient exact zeros, whatever its
    logits; blocks of one row (a GPU's) and of several with valid rows beside masked ones."""
    from rlops.logprobs import triton as kernels

    g = torch.Generator().manual_seed(1)
    n, v = 7, 300
    x = torch.randn(n, v, generator=g)
    valid = torch.tensor([True, False, False, True, False, True, True])
    x[~valid] = float("nan")
    y = torch.randint(0, v, (n,), generator=g)
    keep = torch.rand(n, v, generator=g) < 0.5
    st = kernels.shard_stats(x, y, keep_mask=keep, with_squares=True, row_valid=valid,
                             block_n=block_n)  # fmt: skip
    empty = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert torch.equal(st[~valid], empty.expand(int((~valid).sum()), -1))
    ref = kernels.shard_stats(x[valid], y[valid], keep_mask=keep[valid], with_squares=True,
                              block_n=block_n)  # fmt: skip
    assert torch.equal(st[valid], ref)
    saved = [st[:, 1], st[:, 2].log(), st[:, 3], st[:, 4].log(), st[:, 5]]
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dx = kernels.logits_grad(x, y, saved, gl, ge, keep_mask=keep, row_valid=valid,
                             block_n=block_n)  # fmt: skip
    assert torch.equal(dx[~valid], torch.zeros(int((~valid).sum()), v))
    ref = kernels.logits_grad(x[valid], y[valid], [t[valid] for t in saved], gl[valid],
                              ge[valid], keep_mask=keep[valid], block_n=block_n)  # fmt: skip
    assert torch.equal(dx[valid], ref)


@pytest.mark.parametrize("kw", [{}, {"keep_mask": True, "with_sum_pi_squared": True}])
def test_masked_rows_across_vocabulary_slices(kw):
    """At V = 1000 (two vocabulary slices under the interpreter: the slices' buffer and the
    merge kernel), masked rows are zero and the others the bits of the call without a mask."""
    n = 129
    mask = torch.rand(n, generator=torch.Generator().manual_seed(2)) < 0.5
    (a, ga), (b, gb) = _masked_vs_unmasked(n, 1000, mask, seed=2, **kw)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p[mask], q[mask])
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask]))
    assert torch.equal(ga[mask], gb[mask])
    assert torch.equal(ga[~mask], torch.zeros_like(ga[~mask]))
