"""``logit_scale`` and ``final_logit_softcapping`` on both log-prob ops (Cohere, Granite, Gemma).

The definition, written here plainly in float64: ``x = (h Wᵀ + b) · s``, ``x = c·tanh(x/c)``,
``z = x / τ``, ``log_softmax(z)`` (and the sampler's support on ``z``, via the reference's
:func:`~rlops.logprobs.reference.sampler_keep_mask`). Values and gradients of the ops by the
suite's rule against it (the same definition in float32 sets the error); float64 by
``gradcheck``; bad values; the default path unchanged; a row's bits whatever the batch; two
Gloo ranks with a sharded vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from tests._distributed import run_distributed
from tests._logprobs_util import assert_as_accurate, forward_backward

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import sampler_keep_mask

HEADS = {"scale": (0.0625, None), "softcap": (1.0, 4.0), "scale and softcap": (1.7, 3.0)}
NAMES = ["logp", "entropy", "grad 0", "grad 1", "grad 2"]


def _definition(x, target, *, s, c, tau, keep_mask=None, top_k=None, top_p=None, mask=None):
    """The plain definition on the logits ``x`` (computed in ``x``'s dtype, float32 for half)."""
    x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    x = x * s
    if c is not None:
        x = c * torch.tanh(x / c)
    z = x / tau
    keep = keep_mask
    if top_k is not None or top_p is not None:
        keep = sampler_keep_mask(z.detach(), top_k=top_k, top_p=top_p)
    zk = z
    if keep is not None:
        keep = keep.scatter(-1, target[:, None], True)
        zk = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, -1).gather(-1, target[:, None])[:, 0]
    lp_all = torch.log_softmax(z, -1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    if mask is not None:
        logp, ent = logp * mask, ent * mask
    return logp, ent


def _data(n, v, h, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 4 / h**0.5).to(dtype)
    bias = torch.randn(v, generator=g).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    grads = [torch.randn(n, generator=g), torch.randn(n, generator=g)]
    return hidden, weight, bias, target, grads


def _ops(s, c, kw):
    def fused(logits, target):
        return logprobs_and_entropy(logits, target, logit_scale=s, final_logit_softcapping=c, **kw)

    def linear(h, w, b, target):
        return linear_logprobs_and_entropy(
            h, w, target, bias=b, logit_scale=s, final_logit_softcapping=c, **kw
        )

    return fused, linear


OPTIONS = {
    "temperature, chunks": {"temperature": 0.7, "chunk_size": 5},
    "top_k": {"top_k": 7, "chunk_size": 16},
    "top_p": {"top_p": 0.8, "temperature": 1.3},
    "keep mask": {"keep": True, "chunk_size": 3},
    "row mask": {"mask": True, "chunk_size": 4},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_values_and_gradients_match_the_definition(option, head, dtype):
    s, c = HEADS[head]
    n, v, h = 29, 300, 16
    hidden, weight, bias, target, grads = _data(n, v, h, seed=len(option) + len(head), dtype=dtype)
    kw = dict(OPTIONS[option])
    g = torch.Generator().manual_seed(5)
    defn = {k: kw[k] for k in ("temperature", "top_k", "top_p") if k in kw}
    defn["tau"] = defn.pop("temperature", 1.0)
    if kw.pop("keep", False):
        kw["keep_mask"] = defn["keep_mask"] = torch.rand(n, v, generator=g) < 0.4
    if kw.pop("mask", False):
        kw["mask"] = defn["mask"] = torch.rand(n, generator=g) < 0.7
    fused, linear = _ops(s, c, kw)

    def linear_def(hh, ww, bb, y, **k):
        return _definition(hh @ ww.T + bb, y, **k)

    def logits_def(x, y, **k):
        return _definition(x, y, **k)

    logits = hidden @ weight.T + bias  # the op on logits sees the linear op's logits
    cases = [
        (linear, linear_def, (hidden, weight, bias, target)),
        (fused, logits_def, (logits, target)),
    ]
    for op, definition, inputs in cases:
        fast = forward_backward(op, inputs, grads)
        ref = forward_backward(definition, inputs, grads, s=s, c=c, **defn)
        wide = [x.double() if x.is_floating_point() else x for x in inputs]
        exact = forward_backward(definition, wide, grads, s=s, c=c, **defn)
        for k, name in enumerate(NAMES[: len(fast)]):
            assert_as_accurate(fast[k], ref[k], exact[k], 2.0 if k < 2 else 3.0,
                               f"{op.__name__} {name}")  # fmt: skip


@pytest.mark.parametrize("head", list(HEADS))
def test_float64_gradcheck(head):
    s, c = HEADS[head]
    hidden, weight, bias, target, _ = _data(6, 40, 3, seed=2, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    fused, linear = _ops(s, c, {"temperature": 0.9, "chunk_size": 4})
    assert torch.autograd.gradcheck(lambda *a: linear(*a, target), leaves, fast_mode=True)
    logits = (hidden @ weight.T + bias).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: fused(x, target), (logits,), fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda x: fused(x, target), (logits,), fast_mode=True)


def test_float64_values_are_the_definitions():
    hidden, weight, bias, target, _ = _data(9, 50, 8, seed=3, dtype=torch.float64)
    for s, c in HEADS.values():
        want = _definition(hidden @ weight.T + bias, target, s=s, c=c, tau=0.6)
        got = linear_logprobs_and_entropy(
            hidden, weight, target, bias=bias, temperature=0.6, logit_scale=s,
            final_logit_softcapping=c,
        )  # fmt: skip
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_the_defaults_are_the_op_without_them():
    hidden, weight, bias, target, _ = _data(21, 100, 8, seed=4)
    logits = hidden @ weight.T
    kw = {"temperature": 0.7, "chunk_size": 6}
    plain = logprobs_and_entropy(logits, target, **kw)
    given = logprobs_and_entropy(logits, target, logit_scale=1.0, final_logit_softcapping=None,
                                 **kw)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain, given, strict=True))
    plain = linear_logprobs_and_entropy(hidden, weight, target, bias=bias, **kw)
    given = linear_logprobs_and_entropy(
        hidden, weight, target, bias=bias, logit_scale=1, final_logit_softcapping=None, **kw
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, given, strict=True))


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("logit_scale", 0.0, ValueError),
        ("logit_scale", -1.0, ValueError),
        ("logit_scale", float("nan"), ValueError),
        ("logit_scale", float("inf"), ValueError),
        ("logit_scale", None, TypeError),
        ("logit_scale", True, TypeError),
        ("final_logit_softcapping", 0.0, ValueError),
        ("final_logit_softcapping", -30.0, ValueError),
        ("final_logit_softcapping", float("inf"), ValueError),
        ("final_logit_softcapping", float("nan"), ValueError),
        ("final_logit_softcapping", "30", TypeError),
    ],
)
def test_bad_values_raise_naming_the_argument(name, value, error):
    hidden, weight, _, target, _ = _data(3, 10, 4, seed=5)
    with pytest.raises(error, match=name):
        logprobs_and_entropy(hidden @ weight.T, target, **{name: value})
    with pytest.raises(error, match=name):
        linear_logprobs_and_entropy(hidden, weight, target, **{name: value})


def test_a_row_is_the_same_bits_whatever_the_batch():
    """The linear op with a softcap: a row's log-prob and entropy alone, among others, after
    padding rows, at other chunk sizes."""
    hidden, weight, bias, target, _ = _data(40, 200, 16, seed=6)

    def run(rows, chunk):
        return linear_logprobs_and_entropy(
            hidden[rows], weight, target[rows], bias=bias, temperature=0.8, logit_scale=1.3,
            final_logit_softcapping=5.0, chunk_size=chunk,
        )  # fmt: skip

    every = torch.arange(40)
    base = run(every, None)
    for rows, chunk in [(every[3:4], None), (every[:7], 3), (every.flip(0), 5), (every, 16)]:
        got = run(rows, chunk)
        for a, b in zip(got, base, strict=True):
            assert torch.equal(a, b[rows]), (rows, chunk)


def test_autocast_multiplies_in_its_dtype():
    """Under CPU autocast with float32 hidden states and weight, or bfloat16 hidden states and a
    float32 weight (an autocast model's output): no dtype error; the values are the op on the
    bfloat16-cast inputs, bit for bit; the gradients come back in the inputs' dtypes."""
    hidden, weight, bias, target, grads = _data(20, 64, 8, seed=7)
    want = forward_backward(
        lambda h, w, b: linear_logprobs_and_entropy(h, w, target, bias=b, chunk_size=6),
        [t.bfloat16() for t in (hidden, weight, bias)],
        grads,
    )
    for h0 in (hidden, hidden.bfloat16()):
        leaves = [t.clone().requires_grad_() for t in (h0, weight, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = linear_logprobs_and_entropy(*leaves[:2], target, bias=leaves[2],
                                                  chunk_size=6)  # fmt: skip
        assert torch.equal(lp, want[0]) and torch.equal(ent, want[1])
        torch.autograd.backward([lp, ent], grads)
        for leaf, w in zip(leaves, want[2:], strict=True):
            assert leaf.grad.dtype == leaf.dtype
            assert torch.equal(leaf.grad, w.to(leaf.dtype))


# ----------------------------------------------------------------------- two Gloo ranks
def _tp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    hidden, weight, bias, target, grads = _data(13, 60, 8, seed=8, dtype=torch.float64)
    cols = slice(rank * 30, (rank + 1) * 30)
    leaves = [hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_(),
              bias[cols].clone().requires_grad_()]  # fmt: skip
    kw = {"temperature": 0.9, "logit_scale": 1.4, "final_logit_softcapping": 3.0}
    lp, ent = linear_logprobs_and_entropy(
        leaves[0], leaves[1], target, bias=leaves[2], group=dist.group.WORLD, chunk_size=5, **kw
    )
    torch.autograd.backward([lp, ent], grads)
    mismatch = None
    try:  # rank 1 caps at another value: every rank raises naming the option
        linear_logprobs_and_entropy(
            hidden, weight[cols], target, group=dist.group.WORLD,
            final_logit_softcapping=3.0 if rank == 0 else 4.0,
        )  # fmt: skip
    except ValueError as exc:
        mismatch = str(exc)
    return {"lp": lp.detach(), "ent": ent.detach(), "grads": [t.grad for t in leaves],
            "mismatch": mismatch}  # fmt: skip


def test_tensor_parallel_two_ranks():
    results = run_distributed(_tp_worker, 2)
    hidden, weight, bias, target, grads = _data(13, 60, 8, seed=8, dtype=torch.float64)
    want = forward_backward(
        lambda h, w, b: _definition(h @ w.T + b, target, s=1.4, c=3.0, tau=0.9),
        (hidden, weight, bias),
        grads,
    )
    grad_h = sum(r["grads"][0] for r in results)  # the partial hidden gradients add up
    torch.testing.assert_close(grad_h, want[2], rtol=1e-12, atol=1e-12)
    for rank, r in enumerate(results):
        cols = slice(rank * 30, (rank + 1) * 30)
        torch.testing.assert_close(r["lp"], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["ent"], want[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["grads"][1], want[3][cols], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["grads"][2], want[4][cols], rtol=1e-12, atol=1e-12)
        assert r["mismatch"] is not None and "final_logit_softcapping" in r["mismatch"]
