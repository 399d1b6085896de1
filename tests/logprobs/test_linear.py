"""Fused output layer + log-probs + entropy vs materialised logits, in one process."""

from __future__ import annotations

import pytest
import torch
from tests._logprobs_util import assert_as_accurate, forward_backward, nan_filled_empty

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import linear_logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import logprobs_and_entropy_reference

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0
NAMES = ["logp", "entropy", "grad hidden", "grad weight"]


def _data(n, v, h, *, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5 * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return hidden, weight, target, grads


def _as_accurate(fast, ref32, exact):
    """Values within 2x, gradients within 3x the float32 reference's own error."""
    for k, name in enumerate(NAMES):
        assert_as_accurate(fast[k], ref32[k], exact[k], FACTOR_FWD if k < 2 else FACTOR_GRAD, name)


def _fn(**kw):
    return lambda h, w, y: linear_logprobs_and_entropy(h, w, y, **kw)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_matches_reference(chunk_size, temperature):
    hidden, weight, target, grads = _data(39, 97, 16)
    with nan_filled_empty():
        fast = forward_backward(
            _fn(temperature=temperature, chunk_size=chunk_size), (hidden, weight, target), grads
        )
    ref32 = forward_backward(reference, (hidden, weight, target), grads, temperature=temperature)
    exact = forward_backward(
        reference, (hidden.double(), weight.double(), target), grads, temperature=temperature
    )
    _as_accurate(fast, ref32, exact)


def test_equals_fused_on_materialised_logits():
    """Same maths as ``logprobs_and_entropy(hidden @ weight.T)``, chunk by chunk: as accurate
    against float64 as that two-step form (by the suite's rule, not a fixed tolerance between
    the two: their matmuls have other shapes, whose rounding the CPU's kernels decide)."""
    hidden, weight, target, grads = _data(20, 50, 8, seed=1)
    fast = forward_backward(_fn(chunk_size=6), (hidden, weight, target), grads)

    def two_step(h, w, y):
        return logprobs_and_entropy(h @ w.T, y, chunk_size=6)

    step32 = forward_backward(two_step, (hidden, weight, target), grads)
    exact = forward_backward(two_step, (hidden.double(), weight.double(), target), grads)
    _as_accurate(fast, step32, exact)


def test_bfloat16():
    hidden, weight, target, grads = _data(33, 61, 16, seed=2, dtype=torch.bfloat16)
    fast = forward_backward(_fn(chunk_size=8), (hidden, weight, target), grads)
    # The materialised path rounds the logits to bf16 like the fused one: compare both with the
    # float64 maths on those same bf16 logits.
    logits = (hidden @ weight.T).float()
    lp32, ent32 = logprobs_and_entropy_reference(logits, target)
    lp64, ent64 = logprobs_and_entropy_reference(logits.double(), target)
    assert fast[0].dtype == torch.float32 and fast[2].dtype == fast[3].dtype == torch.bfloat16
    assert_as_accurate(fast[0], lp32, lp64, FACTOR_FWD, "logp")
    assert_as_accurate(fast[1], ent32, ent64, FACTOR_FWD, "entropy")
    # Gradients: the materialised bf16 autograd path is the yardstick.
    mat = forward_backward(reference, (hidden, weight, target), grads)
    exact = forward_backward(reference, (hidden.double(), weight.double(), target), grads)
    for k in (2, 3):
        assert_as_accurate(fast[k], mat[k], exact[k], FACTOR_GRAD, NAMES[k])


def test_leading_dims_and_empty():
    hidden, weight, target, grads = _data(12, 9, 4, seed=3)
    a = forward_backward(
        _fn(chunk_size=5),
        (hidden.view(3, 4, 4), weight, target.view(3, 4)),
        [g.view(3, 4) for g in grads],
    )
    b = forward_backward(_fn(chunk_size=5), (hidden, weight, target), grads)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.reshape(y.shape), y, rtol=0, atol=0)
    h = torch.randn(0, 4, requires_grad=True)
    w = weight.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(h, w, torch.zeros(0, dtype=torch.long))
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (0,) and h.grad.shape == (0, 4) and (w.grad == 0).all()


def test_without_entropy_and_one_input_grad():
    hidden, weight, target, grads = _data(10, 13, 4, seed=4)
    full = forward_backward(_fn(), (hidden, weight, target), [grads[0], None])
    lp, ent, gh, gw = forward_backward(
        _fn(with_entropy=False), (hidden, weight, target), [grads[0], None]
    )
    assert ent is None
    for a, b in zip((lp, gh, gw), (full[0], full[2], full[3]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    w = weight.clone().requires_grad_()
    linear_logprobs_and_entropy(hidden, w, target)[1].sum().backward()  # weight only
    assert w.grad is not None


def test_extreme_weights_are_finite():
    hidden, weight, target, grads = _data(8, 16, 4, seed=6)
    weight = weight.sign() * 2e3  # logits of order ±1e4
    fast = forward_backward(_fn(chunk_size=3), (hidden, weight, target), grads)
    for x, name in zip(fast, NAMES, strict=True):
        assert torch.isfinite(x).all(), name


BAD = [
    ({"weight": torch.zeros(5, 3)}, ValueError, "weight must have shape"),
    ({"weight": torch.zeros(5, 4, dtype=torch.float64)}, TypeError, "weight must have hidden's"),
    ({"hidden": torch.zeros(2, 4, dtype=torch.long)}, TypeError, "hidden must be a floating"),
    ({"target": torch.tensor([0, 5])}, ValueError, "target must hold vocabulary ids"),
    ({"target": torch.tensor([[0, 1]])}, ValueError, "target must have shape"),
    ({"temperature": 0}, ValueError, "temperature must be"),
    ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
    (
        {"keep_mask": torch.ones(2, 4, dtype=torch.bool)},
        ValueError,
        r"keep_mask must have shape \[..., V_local\] like hidden @ weight.T \[2, 5\]",
    ),
    ({"keep_mask": torch.ones(2, 5)}, TypeError, "keep_mask must be a bool tensor"),
    (
        {"keep_mask": torch.ones(2, 5, dtype=torch.bool), "top_p": 0.5},
        ValueError,
        "keep_mask and top_k / top_p / min_p are exclusive",
    ),
    ({"entropy_grad": 1}, TypeError, "entropy_grad must be a bool"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_inputs(change, error, match):
    args = {
        "hidden": torch.zeros(2, 4),
        "weight": torch.zeros(5, 4),
        "target": torch.tensor([0, 4]),
        **change,
    }
    with pytest.raises(error, match=match):
        linear_logprobs_and_entropy(
            args.pop("hidden"), args.pop("weight"), args.pop("target"), **args
        )


def _keep(n, v, target, seed):
    keep = torch.rand(n, v, generator=torch.Generator().manual_seed(seed)) < 0.4
    keep[: n // 4] = False  # rows whose only kept token is the target
    keep[:, 0] = False  # a column dropped everywhere
    return keep


@pytest.mark.parametrize("chunk_size", [1, 6, None])
def test_keep_mask_matches_the_definition(chunk_size):
    """The log-prob over the kept logits (the target always kept), the entropy over all, read
    from the mask chunk by chunk: as the reference on materialised logits, in float64 too."""
    hidden, weight, target, grads = _data(41, 53, 8, seed=7)
    keep = _keep(41, 53, target, 8)
    fast = forward_backward(
        _fn(keep_mask=keep, chunk_size=chunk_size), (hidden, weight, target), grads
    )
    ref32 = forward_backward(reference, (hidden, weight, target), grads, keep_mask=keep)
    exact = forward_backward(
        reference, (hidden.double(), weight.double(), target), grads, keep_mask=keep
    )
    _as_accurate(fast, ref32, exact)
    # hand-checked rows: only the target kept -> log-prob 0
    assert (fast[0][: 41 // 4] == 0).all()


def test_keep_mask_gradcheck_float64():
    hidden, weight, target, _ = _data(9, 11, 3, seed=9, dtype=torch.float64)
    keep = _keep(9, 11, target, 10)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: linear_logprobs_and_entropy(a, b, target, keep_mask=keep, chunk_size=4),
        (h, w),
    )


def test_entropy_grad_off_detaches_the_entropy_only():
    hidden, weight, target, grads = _data(17, 23, 4, seed=11)
    with_grad = forward_backward(_fn(), (hidden, weight, target), [grads[0], None])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(h, w, target, entropy_grad=False)
    assert not ent.requires_grad and lp.requires_grad
    torch.testing.assert_close(ent, with_grad[1], rtol=0, atol=0)
    lp.backward(grads[0])
    torch.testing.assert_close(h.grad, with_grad[2], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, with_grad[3], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_backward_over_vocabulary_tiles(dtype, masked):
    """Without a sampler threshold the backward runs over [tokens, vocabulary] tiles (several
    of each here: V = 700, chunk 4): the same gradients as the reference, as accurate."""
    hidden, weight, target, grads = _data(50, 700, 8, seed=12, dtype=dtype)
    kw = {"keep_mask": _keep(50, 700, target, 13)} if masked else {}
    fast = forward_backward(_fn(chunk_size=4, **kw), (hidden, weight, target), grads)
    mat = forward_backward(reference, (hidden, weight, target), grads, **kw)
    exact = forward_backward(reference, (hidden.double(), weight.double(), target), grads, **kw)
    if dtype == torch.float32:
        _as_accurate(fast, mat, exact)
    else:  # values as test_bfloat16; the gradients against the materialised bf16 path
        for k in (2, 3):
            assert_as_accurate(fast[k], mat[k], exact[k], FACTOR_GRAD, NAMES[k])
