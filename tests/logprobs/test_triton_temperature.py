"""A per-row ``temperature`` tensor in the Triton kernels (``method="triton"``), under the CPU
interpreter.

Expected values from the definition: ``z = x / τ_row``, ``logp = log_softmax(z over the
support ∪ {target})[target]``, ``H = −Σ softmax(z)·log_softmax(z)``, their gradient w.r.t.
``x`` by float64 autograd of that formula (a ``longdouble`` oracle for float64 inputs), with
the suite's rule (``tests.tolerances``): the same-dtype reference's error sets the tolerance.
Odd sizes, several row blocks and vocabulary slices (the interpreter's tiles are 256 wide,
two per slice, so V = 1000 crosses tiles and merges slices), a keep mask, the sampler's
support, ``[B, T]`` inputs with a row mask and chunks, vocabulary shards merged, gradcheck, a
constant tensor against the float (the same bits), the routing and the errors.
"""

from __future__ import annotations

import pytest
import torch
from tests._logprobs_util import (
    assert_as_accurate,
    assert_as_accurate_as_float64,
    forward_backward,
    longdouble_oracle,
    nan_filled_empty,
)
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)
from tests.tolerances import assert_half_matches

from rlops.logprobs import _options, _softmax, logprobs_and_entropy
from rlops.logprobs import triton as kernels
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import sampler_keep_mask

FACTORS = (2.0, 2.0, 3.0)  # logp, entropy, gradient (tests.tolerances)
WHAT = ("logp", "entropy", "grad")

# numpy on the interpreter's masked lanes (exp(-inf), log 0) warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _kernels_ran():
    """The kernels stay in use: a silent fallback to the torch maths would make the
    comparisons vacuous."""
    yield
    assert _options.failed() is None, f"the kernels were set aside: {_options.failed()}"


def _data(n, v, dtype, seed, keep_frac=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    tau = torch.rand(n, generator=gen, dtype=torch.float64) * 1.8 + 0.2
    keep = None
    if keep_frac is not None:
        keep = torch.rand(n, v, generator=gen) < keep_frac
        keep.scatter_(-1, y.unsqueeze(-1), False)  # the op keeps the target anyway
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return x, y, tau.to(wide), keep, grads


def _definition(x, y, tau, support, grads):
    """``[logp, entropy, grad]`` in float64 from the formulas above (``support`` ``[N, V]``
    bool or None: all logits)."""
    x = x.double().requires_grad_()
    z = x / tau.double()[:, None]
    zk = z
    if support is not None:
        kept = support | torch.nn.functional.one_hot(y, z.shape[-1]).bool()
        zk = z.masked_fill(~kept, float("-inf"))
    logp = torch.log_softmax(zk, dim=-1).gather(-1, y[:, None]).squeeze(-1)
    ent = -(torch.softmax(z, dim=-1) * torch.log_softmax(z, dim=-1)).sum(-1)
    torch.autograd.backward([logp, ent], [g.double() for g in grads])
    return [logp.detach(), ent.detach(), x.grad]


def _check(x, y, tau, grads, support=None, **kw):
    """``method="triton"`` with ``temperature=tau`` (and ``kw``) against the definition
    (``support``: the log-prob's support, None for all logits), the same-dtype reference's
    error the yardstick; half-precision gradients within one ulp of the float32 reference's."""
    op = lambda a, b: logprobs_and_entropy(a, b, method="triton", temperature=tau, **kw)  # noqa: E731
    with nan_filled_empty():
        fast = forward_backward(op, (x, y), grads)
    acc = tau.dtype
    ref = forward_backward(reference, (x.to(acc), y), grads, temperature=tau, keep_mask=support)
    if x.dtype == torch.float64:
        keep = torch.ones_like(x, dtype=torch.bool) if support is None else support
        tau_ld = tau.numpy()[:, None]  # longdouble_oracle divides by it: one per row
        oracle = longdouble_oracle(x, y, keep, grads, temperature=tau_ld)
        for k in range(3):
            assert_as_accurate_as_float64(fast[k], ref[k], oracle[k], FACTORS[k], WHAT[k])
        return fast
    exact = _definition(x, y, tau, support, grads)
    for k in range(3):
        if k == 2 and x.dtype != torch.float32:
            assert fast[2].dtype == x.dtype
            assert_half_matches("triton grad", fast[2], ref[2], exact[2])
            continue
        assert_as_accurate(fast[k], ref[k], exact[k], FACTORS[k], f"triton {WHAT[k]}")
    return fast


# --------------------------------------------------------------------------- values, gradients
@pytest.mark.parametrize("n", [1, 127, 128, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_the_definition(n, dtype, masked):
    x, y, tau, keep, grads = _data(n, 1000, dtype, seed=n, keep_frac=0.4 if masked else None)
    _check(x, y, tau, grads, support=keep, keep_mask=keep)


@pytest.mark.parametrize("v", [1, 127, 129, 513])
def test_vocabulary_sizes(v):
    x, y, tau, _, grads = _data(37, v, torch.float32, seed=v)
    _check(x, y, tau, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("over_support", [False, True])
def test_sampler_support_on_the_tempered_logits(dtype, over_support):
    """top-k / top-p on each row's ``x / τ_row``: the support of the float32 scaled logits
    (the reference's filters), the threshold found by the engine, applied in the kernels."""
    x, y, tau, _, grads = _data(45, 700, dtype, seed=7)
    support = sampler_keep_mask(x.float() / tau[:, None], top_k=40, top_p=0.8)
    kw = {"top_k": 40, "top_p": 0.8}
    if not over_support:
        _check(x, y, tau, grads, support=support, **kw)
        return
    got = logprobs_and_entropy(x, y, temperature=tau, method="triton", entropy_over_support=True,
                               **kw)  # fmt: skip
    want = reference(x.float(), y, temperature=tau, keep_mask=support, entropy_over_support=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_btv_rows_a_row_mask_and_chunks():
    """``[B, T, V]`` logits with a ``[B]`` temperature (row ``b``'s for its ``T`` tokens), a
    row mask (the kernels' masked programs) and chunks of 7 tokens (each chunk its slice of
    the per-token temperatures): the chunked method's values and gradient, and the definition
    on the unmasked tokens."""
    b, t, v = 3, 11, 600
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, v, (b, t), generator=gen)
    tau = torch.tensor([0.4, 1.0, 2.5], dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) < 0.7
    grads = [torch.randn(b, t, generator=gen), torch.randn(b, t, generator=gen)]
    kw = {"temperature": tau, "mask": mask, "chunk_size": 7}
    outs = [
        forward_backward(logprobs_and_entropy, (x, y), grads, method=m, **kw)
        for m in ("triton", "chunked")
    ]
    for a, c in zip(*outs, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    rows = tau.repeat_interleave(t)
    want = _definition(x.reshape(-1, v), y.reshape(-1), rows, None,
                       [g.reshape(-1) for g in grads])  # fmt: skip
    keep = mask.reshape(-1)
    for k in range(2):
        torch.testing.assert_close(outs[0][k].reshape(-1)[keep], want[k][keep], rtol=1e-12,
                                   atol=1e-12)  # fmt: skip
    grad = outs[0][2].reshape(-1, v)
    torch.testing.assert_close(grad[keep], want[2][keep], rtol=1e-12, atol=1e-12)
    assert (grad[~keep] == 0).all()


def test_gradcheck():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (5,), generator=gen)
    tau = torch.tensor([0.3, 0.7, 1.0, 1.6, 4.0], dtype=torch.float64)
    keep = torch.rand(5, 40, generator=gen) < 0.5
    for kw in ({}, {"keep_mask": keep}):
        assert torch.autograd.gradcheck(
            lambda a, kw=kw: logprobs_and_entropy(a, y, temperature=tau, method="triton", **kw),
            (x,),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_constant_tensor_is_the_float(dtype):
    """Every row at τ: the float's bits, forward and backward (the same division by τ per
    element and the same ``1/τ`` per row)."""
    x, y, _, keep, grads = _data(33, 700, dtype, seed=3, keep_frac=0.5)
    for kw in ({}, {"keep_mask": keep}, {"top_k": 30}):
        tau = torch.full((33,), 0.7, dtype=torch.float32)
        got = forward_backward(logprobs_and_entropy, (x, y), grads, method="triton",
                               temperature=tau, **kw)  # fmt: skip
        want = forward_backward(logprobs_and_entropy, (x, y), grads, method="triton",
                                temperature=0.7, **kw)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), kw


@pytest.mark.parametrize("masked", [False, True])
def test_shards_merge_to_the_whole_vocabulary(masked):
    """Two vocabulary shards (the second at an offset) with per-row temperatures, merged as
    under tensor parallelism: the definition; each shard's gradient its slice."""
    x, y, tau, keep, grads = _data(21, 300, torch.float64, seed=13,
                                   keep_frac=0.5 if masked else None)  # fmt: skip
    cuts = [(0, 128), (128, 300)]
    part = [None if keep is None else keep[:, a:b] for a, b in cuts]
    stats = torch.stack([
        kernels.shard_stats(x[:, a:b], y, offset=a, temperature=tau, block_n=8, block_v=64,
                            keep_mask=k)
        for (a, b), k in zip(cuts, part, strict=True)
    ])  # fmt: skip
    logp, ent, saved = _softmax.merge(stats, masked, True)
    want = _definition(x, y, tau, keep, grads)
    torch.testing.assert_close(logp, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want[1], rtol=1e-12, atol=1e-12)
    for (a, b), k in zip(cuts, part, strict=True):
        g = kernels.logits_grad(x[:, a:b], y, saved, grads[0], grads[1], offset=a,
                                temperature=tau[:, None], keep_mask=k, block_n=8,
                                block_v=64)  # fmt: skip
        torch.testing.assert_close(g, want[2][:, a:b], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- routing, errors
def test_triton_and_auto_keep_the_kernels_for_a_tensor(monkeypatch):
    """``method="triton"`` (and ``"auto"`` where it chooses the kernels) runs a per-row
    temperature on the kernels, not the chunked maths."""
    x = torch.randn(4, 9)
    y = torch.tensor([0, 1, 2, 8])
    opts = _options.Options(temperature=torch.tensor([0.5, 1.0, 2.0, 4.0]))
    assert _options.checked("logits", x, y, opts, method="triton").method == "triton"
    monkeypatch.setattr(_options, "resolve", lambda method, x: "triton")  # auto on CUDA
    assert _options.checked("logits", x, y, opts, method="auto").method == "triton"


def test_kernel_temperature_errors():
    x = torch.randn(4, 9)
    y = torch.tensor([0, 1, 2, 8])
    for bad in (torch.ones(3), torch.ones(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"temperature must be a float or a floating \[4\]"):
            kernels.shard_stats(x, y, temperature=bad)
        with pytest.raises(ValueError, match=r"temperature must be a float or a floating \[4\]"):
            kernels.logits_grad(x, y, [y.float(), y.float()], y.float(), None, temperature=bad)
