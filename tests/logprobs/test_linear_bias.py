"""``linear_logprobs_and_entropy(..., bias=b)``: the output layer ``hidden @ weightᵀ + b``, fused.

Against the reference on materialised logits (``F.linear`` then ``log_softmax``): float32 values
within twice, gradients (hidden, weight, bias) within three times the float32 reference's error
against float64; bfloat16 against the materialised bf16 layer; float64 gradients by
``gradcheck`` (and ``gradgradcheck`` for double backward), through the tiled backward and the
sampler's row-chunk backward. The bias split over a tensor-parallel group:
tests/logprobs/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from tests._bad_input import names
from tests._logprobs_util import assert_as_accurate, forward_backward, nan_filled_empty

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import linear_logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import logprobs_and_entropy_reference

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0
NAMES = ["logp", "entropy", "grad hidden", "grad weight", "grad bias"]


def _data(n, v, h, *, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5 * 3).to(dtype)
    bias = (torch.randn(v, generator=gen) * 2).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return hidden, weight, bias, target, grads


def _fused(**kw):
    return lambda h, w, b, y: linear_logprobs_and_entropy(h, w, y, bias=b, **kw)


def _reference(**kw):
    return lambda h, w, b, y: reference(h, w, y, bias=b, **kw)


def _keep(n, v, seed):
    return torch.rand(n, v, generator=torch.Generator().manual_seed(seed)) < 0.4


@pytest.mark.parametrize("v", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize(
    "kw",
    [{}, {"temperature": 0.7, "chunk_size": 7}, {"keep": True, "chunk_size": 1},
     {"top_k": 9, "temperature": 1.3, "chunk_size": 16}, {"with_entropy": False}],
    ids=["plain", "temperature, chunks", "keep mask, chunks of one", "top_k", "no entropy"],
)  # fmt: skip
def test_matches_reference(v, kw):
    """Also the tiled backward (V above 256 with a small chunk): its tiles' logits are made
    chunk by chunk, with the forward's bits."""
    hidden, weight, bias, target, grads = _data(37, v, 16, seed=v)
    kw = dict(kw)
    if kw.pop("keep", False):
        kw["keep_mask"] = _keep(37, v, v)
    chunk = kw.pop("chunk_size", None)
    inputs = (hidden, weight, bias, target)
    with nan_filled_empty():
        fast = forward_backward(_fused(chunk_size=chunk, **kw), inputs, grads)
    ref32 = forward_backward(_reference(**kw), inputs, grads)
    exact = forward_backward(
        _reference(**kw), (hidden.double(), weight.double(), bias.double(), target), grads
    )
    assert fast[4].dtype == torch.float32 and fast[4].shape == (v,)
    for k, name in enumerate(NAMES):
        if exact[k] is None:
            assert fast[k] is None, name
            continue
        assert_as_accurate(fast[k], ref32[k], exact[k], FACTOR_FWD if k < 2 else FACTOR_GRAD,
                           name)  # fmt: skip


def test_bias_gradient_is_the_logit_gradient_summed_over_tokens():
    """``∂L/∂b_v = Σ_t ∂L/∂z_tv``: the bias gradient against the logits' gradient of the same
    op on materialised logits, for leading dims ``[B, T]`` (float64)."""
    from rlops.logprobs import logprobs_and_entropy

    hidden, weight, bias, target, grads = _data(24, 50, 8, seed=1, dtype=torch.float64)
    h3, y3 = hidden.view(4, 6, 8), target.view(4, 6)
    g3 = [g.double().view(4, 6) for g in grads]
    fast = forward_backward(_fused(chunk_size=5, temperature=0.8), (h3, weight, bias, y3), g3)
    logits = torch.nn.functional.linear(h3, weight, bias)
    lp_ent_grad = forward_backward(
        lambda z, y: logprobs_and_entropy(z, y, temperature=0.8), (logits, y3), g3
    )
    torch.testing.assert_close(fast[4], lp_ent_grad[2].sum(dim=(0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw", [{"chunk_size": 3, "temperature": 1.4},
                                {"top_p": 0.7, "chunk_size": 2},
                                {"keep": True, "entropy_grad": False}])  # fmt: skip
def test_gradcheck(kw):
    """float64 ``gradcheck`` of (logp, entropy) w.r.t. hidden, weight and bias: the tiled
    backward, the sampler's row-chunk backward, and an entropy without gradient."""
    hidden, weight, bias, target, _ = _data(6, 300, 3, seed=2, dtype=torch.float64)
    kw = dict(kw)
    if kw.pop("keep", False):
        kw["keep_mask"] = _keep(6, 300, 2)
    detached = kw.get("entropy_grad") is False

    def fn(h, w, b):
        lp, ent = linear_logprobs_and_entropy(h, w, target, bias=b, **kw)
        return lp if detached else (lp, ent)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)


def test_gradgradcheck():
    hidden, weight, bias, target, _ = _data(4, 11, 3, seed=3, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradgradcheck(
        lambda h, w, b: linear_logprobs_and_entropy(h, w, target, bias=b, chunk_size=3),
        leaves,
        fast_mode=True,
    )


def test_only_the_bias_requires_grad():
    hidden, weight, bias, target, grads = _data(10, 13, 4, seed=4)
    b = bias.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(hidden, weight, target, bias=b, chunk_size=3)
    torch.autograd.backward([lp, ent], grads)
    full = forward_backward(_fused(chunk_size=3), (hidden, weight, bias, target), grads)
    torch.testing.assert_close(b.grad, full[4], rtol=0, atol=0)


def _materialised(h, w, b, y):
    """The bf16 layer as the op computes it: ``h @ wᵀ`` then ``+ b``, each rounded to bf16."""
    return logprobs_and_entropy_reference(h @ w.T + b, y)


def test_bfloat16():
    """The materialised bf16 layer is the yardstick: values from its bf16 logits in float32,
    the gradients of its bf16 autograd path; the bias gradient comes back in bf16."""
    hidden, weight, bias, target, grads = _data(33, 61, 16, seed=5, dtype=torch.bfloat16)
    inputs = (hidden, weight, bias, target)
    fast = forward_backward(_fused(chunk_size=8), inputs, grads)
    assert fast[4].dtype == torch.bfloat16
    logits = hidden @ weight.T + bias  # bf16, as the layer rounds them
    values32 = logprobs_and_entropy_reference(logits.float(), target)
    values64 = logprobs_and_entropy_reference(logits.double(), target)
    for k in (0, 1):
        assert_as_accurate(fast[k], values32[k], values64[k], FACTOR_FWD, NAMES[k])
    mat = forward_backward(_materialised, inputs, grads)
    exact = forward_backward(_reference(), (hidden.double(), weight.double(), bias.double(),
                                            target), grads)  # fmt: skip
    for k in (2, 3, 4):
        assert_as_accurate(fast[k], mat[k], exact[k], FACTOR_GRAD, NAMES[k])


def test_zero_bias_is_no_bias():
    hidden, weight, bias, target, grads = _data(20, 30, 6, seed=6)
    with_zero = forward_backward(_fused(chunk_size=7), (hidden, weight, bias * 0, target), grads)
    without = forward_backward(lambda h, w, y: linear_logprobs_and_entropy(h, w, y, chunk_size=7),
                               (hidden, weight, target), grads)  # fmt: skip
    for a, b in zip(with_zero[:4], without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


BAD = [
    (torch.zeros(6), ValueError, r"bias must have shape \[V_local\] like weight's rows \[5\]"),
    (torch.zeros(5, 1), ValueError, "bias must have shape"),
    (torch.zeros(5, dtype=torch.float64), TypeError, "bias must have hidden's dtype"),
    ([0.0] * 5, TypeError, "bias must be a torch.Tensor or None"),
    (torch.zeros(5, device="meta"), ValueError, "bias is on meta but hidden is on cpu"),
]


@pytest.mark.parametrize(("bias", "kind", "match"), BAD)
def test_bad_bias(bias, kind, match):
    with pytest.raises(kind, match=match):
        linear_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.tensor([0, 1]),
                                    bias=bias)  # fmt: skip


N_BAD, H_BAD, V_BAD = 5, 4, 7
DTYPE = "hidden's dtype torch.float32"
BAD_NAMED = [
    (torch.zeros(V_BAD, dtype=torch.long), TypeError, DTYPE),
    (torch.zeros(V_BAD, dtype=torch.bool), TypeError, DTYPE),
    (torch.zeros(V_BAD, dtype=torch.float64), TypeError, DTYPE),
    (torch.zeros(V_BAD, dtype=torch.bfloat16), TypeError, DTYPE),
    (torch.zeros(V_BAD, dtype=torch.complex64), TypeError, DTYPE),
    (torch.zeros(V_BAD - 1), ValueError, "[V_local]"),
    (torch.zeros(V_BAD + 1), ValueError, "[7]"),
    (torch.zeros(1, V_BAD), ValueError, "[V_local]"),
    (torch.tensor(0.0), ValueError, "[V_local]"),
    ([0.0] * V_BAD, TypeError, "torch.Tensor or None"),
    (0.0, TypeError, "torch.Tensor or None"),
    (torch.zeros(V_BAD, device="meta"), ValueError, "one device"),
]


def _small(**kw):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N_BAD, H_BAD, generator=g), torch.randn(V_BAD, H_BAD, generator=g)
    target = torch.randint(0, V_BAD, (N_BAD,), generator=g)
    return linear_logprobs_and_entropy(hidden, weight, target, **kw), (hidden @ weight.T, target)


@pytest.mark.parametrize(
    ("bias", "exc", "words"), BAD_NAMED, ids=[f"{i}" for i in range(len(BAD_NAMED))]
)
def test_bad_bias_raises_naming_it(bias, exc, words):
    with pytest.raises(exc, match=names("bias")) as info:
        _small(bias=bias)
    assert words in str(info.value)


def test_nan_bias_entry_reaches_every_log_prob():
    # a NaN bias entry is data: every token's log-sum-exp reads it, so every log-prob is NaN
    bias = torch.zeros(V_BAD)
    bias[3] = float("nan")
    (logp, _), _ = _small(bias=bias)
    assert logp.isnan().all()


def test_zero_bias_runs_as_the_logits_op():
    (logp, _), logits_target = _small(bias=torch.zeros(V_BAD))
    torch.testing.assert_close(logp, logprobs_and_entropy(*logits_target)[0])
