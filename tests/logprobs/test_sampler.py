"""Log-probs under the sampler's support (top-k, top-p, min-p) built inside the chunk loop, vs
float64 references that build the full logits and the support token by token."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import run_distributed
from tests._logprobs_util import assert_as_accurate, forward_backward, nan_filled_empty

from rlops.logprobs import (
    _support,
    linear_logprobs_and_entropy,
    logprobs_and_entropy,
)
from rlops.logprobs import _tensor_parallel as _tp

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0
INF = float("inf")


# --------------------------------------------------------------------------- references
def _param(p, row):
    if p is None:
        return None
    return p.reshape(-1)[row].item() if isinstance(p, torch.Tensor) else p


def support_chunk(z, top_k, top_p, min_p):
    """``[C, V]`` bool: the support of scaled logits ``z``, the tokens at or above the engine's
    threshold (:func:`rlops.logprobs._support.threshold_chunk`)."""
    return z >= _support.threshold_chunk(z, top_k, top_p, min_p)


def support_row(z: list[float], top_k=None, top_p=None, min_p=None) -> list[bool]:
    """The sampler's support of one token's scaled logits, with plain Python floats (float64):
    vLLM's order (min-p, then top-k, then top-p on the renormalised rest), ties kept."""
    v = len(z)
    desc = sorted(z, reverse=True)
    t = -INF
    if min_p is not None and min_p > 0:
        probs = [math.exp(x - desc[0]) for x in z]  # relative to the max probability
        t = max(t, min(x for x, q in zip(z, probs, strict=True) if q >= min_p))
    if top_k is not None and top_k < v:
        t = max(t, desc[top_k - 1])
    if top_p is not None and top_p < 1:
        kept = [x for x in desc if x >= t]
        w = [math.exp(x - kept[0]) for x in kept]
        total = math.fsum(w)
        before = 0.0
        for x, wx in zip(kept, w, strict=True):
            if before >= top_p:
                break
            t_p = x
            before += wx / total
        t = max(t, t_p)
    return [x >= t for x in z]


def reference_support(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """``[..., V]`` bool support from the logits in float64, one token at a time."""
    z = (logits.double() / temperature).reshape(-1, logits.shape[-1])
    rows = [
        support_row(z[r].tolist(), _param(top_k, r), _param(top_p, r), _param(min_p, r))
        for r in range(z.shape[0])
    ]
    return torch.tensor(rows, dtype=torch.bool).reshape(logits.shape)


def reference(logits, target, support, *, temperature=1.0, over_support=False):
    """Log-prob over ``support ∪ {target}`` and entropy over all logits (or over that support),
    on the materialised ``[..., V]`` logits in their own dtype."""
    z = logits / temperature
    idx = target.unsqueeze(-1)
    keep = support.scatter(-1, idx, True)
    zk = z.masked_fill(~keep, -INF)
    log_pk = torch.log_softmax(zk, dim=-1)
    logp = log_pk.gather(-1, idx).squeeze(-1)
    if over_support:
        ent = -(torch.softmax(zk, -1) * log_pk.masked_fill(~keep, 0.0)).sum(-1)
    else:
        ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return logp, ent


# --------------------------------------------------------------------------- helpers
def _data(shape, v, *, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=gen) * scale).float()
    target = torch.randint(0, v, shape, generator=gen)
    grads = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)]
    return logits, target, grads


SAMPLER_KEYS = ("top_k", "top_p", "min_p")


def _check(logits, target, grads, **kw):
    """Fused (float32) vs the float64 reference, with the float32 reference's error as the
    yardstick; the support is the float64 reference's, checked to equal the float32 one."""
    tau = kw.get("temperature", 1.0)
    sampler = {k: kw[k] for k in SAMPLER_KEYS if k in kw}
    support = reference_support(logits, tau, **sampler)
    z32 = (logits.float() / tau).reshape(-1, logits.shape[-1])
    params = _support.Sampler(
        *(
            kw[k].reshape(-1) if isinstance(kw.get(k), torch.Tensor) else kw.get(k)
            for k in SAMPLER_KEYS
        )
    ).rows(0, z32.shape[0])
    assert torch.equal(support_chunk(z32, *params).reshape(logits.shape), support)
    over = kw.get("entropy_over_support", False)
    ref_kw = {"temperature": tau, "over_support": over}
    with nan_filled_empty():
        fast = forward_backward(
            lambda x, y: logprobs_and_entropy(x, y, **kw), (logits, target), grads
        )
    ref32 = forward_backward(
        lambda x, y: reference(x, y, support, **ref_kw), (logits.float(), target), grads
    )
    exact = forward_backward(
        lambda x, y: reference(x, y, support, **ref_kw), (logits.double(), target), grads
    )
    for k, (what, factor) in enumerate(
        [("logp", FACTOR_FWD), ("entropy", FACTOR_FWD), ("grad", FACTOR_GRAD)]
    ):
        assert torch.isfinite(fast[k]).all(), what
        assert_as_accurate(fast[k], ref32[k], exact[k], factor, what)
    return fast, support


# --------------------------------------------------------------------------- values, gradients
CASES = {
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "top_k and top_p": {"top_k": 10, "top_p": 0.6},
    "min_p": {"min_p": 0.05},
    "all three": {"top_k": 20, "top_p": 0.9, "min_p": 0.01},
    "k >= V": {"top_k": 500},
    "p = 1": {"top_p": 1.0},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("over_support", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_matches_reference(case, temperature, over_support, chunk_size):
    logits, target, grads = _data((3, 13), 97)
    _check(
        logits,
        target,
        grads,
        **CASES[case],
        temperature=temperature,
        entropy_over_support=over_support,
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("over_support", [False, True])
def test_per_token_parameters(over_support):
    logits, target, grads = _data((4, 10), 61, seed=1)
    gen = torch.Generator().manual_seed(11)
    top_k = torch.randint(1, 80, (4, 10), generator=gen)  # some >= V: keep all
    top_p = torch.rand(4, 10, generator=gen) * 0.9 + 0.05
    top_p[0, :3] = 1.0
    min_p = torch.rand(4, 10, generator=gen) * 0.05
    min_p[1] = 0.0
    for kw in (
        {"top_k": top_k},
        {"top_p": top_p},
        {"min_p": min_p},
        {"top_k": top_k, "top_p": top_p, "min_p": min_p},
        {"top_k": 7, "top_p": top_p},
    ):
        _check(
            logits,
            target,
            grads,
            **kw,
            temperature=0.9,
            chunk_size=6,
            entropy_over_support=over_support,
        )


def test_ties_keep_every_tied_logit():
    # Integer logits: exact in float32 and after dividing by 0.5, so ties stay ties.
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0, -1.0]])
    y = torch.tensor([0])
    # top-k = 2: the 2nd largest value is 2, held by three tokens: all three are kept.
    assert support_row(z[0].tolist(), top_k=2) == [True, False, True, True, False, True, False]
    w = torch.softmax(z[0].double(), 0)
    # top-p just above the top token's mass: the crossing value 2 is tied three times.
    p = float(w[0]) + 1e-3
    assert support_row(z[0].tolist(), top_p=p) == [True, False, True, True, False, True, False]
    for kw in ({"top_k": 2}, {"top_p": p}, {"top_k": 3, "top_p": 0.99}):
        sup = support_chunk(z, *_support.Sampler(kw.get("top_k"), kw.get("top_p"), None).rows(0, 1))
        assert torch.equal(sup, reference_support(z, **kw))
        lp, _ = logprobs_and_entropy(z, y, **kw)
        kept = z[0][reference_support(z, **kw)[0]]
        torch.testing.assert_close(lp, (3.0 - torch.logsumexp(kept, 0)).reshape(1))
    # top-k = 2 keeps the four tokens tied at 2; top-p then crosses p inside that tie, beyond
    # the k values the top-k pass returns: all four stay.
    z2 = torch.tensor([[3.0, 2.0, 2.0, 0.0, 2.0, 2.0]])
    expected = torch.tensor([[True, True, True, False, True, True]])
    for p in (0.6, 0.99):
        assert torch.equal(reference_support(z2, top_k=2, top_p=p), expected)
        assert torch.equal(support_chunk(z2, 2, p, None), expected)
        assert torch.equal(support_chunk(z2, torch.tensor([[2]]), p, None), expected)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-3, 4, (40, 50), generator=gen).float()
    target = torch.randint(0, 50, (40,), generator=gen)
    grads = [torch.randn(40, generator=gen), torch.randn(40, generator=gen)]
    for kw in ({"top_k": 4}, {"top_k": 9, "top_p": 0.7}, {"top_p": 0.37}, {"min_p": 0.1}):
        for tau in (0.5, 1.0):
            _check(logits, target, grads, **kw, temperature=tau, chunk_size=9)
            _check(logits, target, grads, **kw, temperature=tau, entropy_over_support=True)


def test_support_of_one_token():
    logits, _, grads = _data((20,), 33, seed=3)
    argmax = logits.argmax(-1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        lp, ent = logprobs_and_entropy(logits, argmax, **kw, entropy_over_support=True)
        assert (lp == 0).all() and (ent == 0).all()
        x = logits.clone().requires_grad_()
        lp, ent = logprobs_and_entropy(x, argmax, **kw)
        lp.sum().backward()
        assert (x.grad == 0).all()  # a one-token distribution does not move
        _check(logits, argmax, grads, **kw)
        _check(logits, argmax, grads, **kw, entropy_over_support=True)


def test_target_outside_the_nominal_support():
    logits, _, grads = _data((3, 7), 40, seed=4)
    argmin = logits.argmin(-1)
    for kw in ({"top_k": 1}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2}):
        fast, support = _check(logits, argmin, grads, **kw, temperature=1.1)
        assert not support.gather(-1, argmin.unsqueeze(-1)).any()
        assert (fast[0] < 0).all()
        _check(logits, argmin, grads, **kw, entropy_over_support=True)
    # top_k = 1 and the target elsewhere: the support is {argmax, target}.
    lp, _ = logprobs_and_entropy(logits, argmin, top_k=1)
    pair = torch.stack([logits.amax(-1), logits.amin(-1)], -1)
    torch.testing.assert_close(lp, logits.amin(-1) - torch.logsumexp(pair, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    logits, target, grads = _data((5, 11), 257, seed=5)
    logits = logits.to(dtype)
    kw = {"top_k": 40, "top_p": 0.85, "temperature": 0.8}
    support = reference_support(logits, 0.8, top_k=40, top_p=0.85)
    fast = forward_backward(
        lambda x, y: logprobs_and_entropy(x, y, **kw, chunk_size=4), (logits, target), grads
    )
    ref32 = forward_backward(
        lambda x, y: reference(x, y, support, temperature=0.8), (logits.float(), target), grads
    )
    exact = forward_backward(
        lambda x, y: reference(x, y, support, temperature=0.8), (logits.double(), target), grads
    )
    assert fast[0].dtype == fast[1].dtype == torch.float32 and fast[2].dtype == dtype
    assert_as_accurate(fast[0], ref32[0], exact[0], FACTOR_FWD, "logp")
    assert_as_accurate(fast[1], ref32[1], exact[1], FACTOR_FWD, "entropy")
    assert_as_accurate(fast[2], ref32[2].to(dtype), exact[2], FACTOR_GRAD, "grad")


def test_same_as_the_replayed_keep_mask():
    """The support built in the loop gives exactly what the same support gives as keep_mask."""
    logits, target, grads = _data((30,), 64, seed=6)
    kw = {"top_k": 12, "top_p": 0.75, "temperature": 0.6}
    support = support_chunk(logits / 0.6, 12, 0.75, None)
    a = forward_backward(
        lambda x, y: logprobs_and_entropy(x, y, **kw, chunk_size=7), (logits, target), grads
    )
    b = forward_backward(
        lambda x, y: logprobs_and_entropy(x, y, temperature=0.6, keep_mask=support, chunk_size=7),
        (logits, target),
        grads,
    )
    for u, w in zip(a, b, strict=True):
        torch.testing.assert_close(u, w, rtol=0, atol=0)


def test_chunk_sizes_agree_and_the_support_is_per_chunk(monkeypatch):
    logits, target, grads = _data((50,), 33, seed=7)
    seen = []
    original = _support.threshold_chunk

    def spy(z, *args):
        seen.append(z.shape[0])
        return original(z, *args)

    monkeypatch.setattr(_support, "threshold_chunk", spy)
    kw = {"top_k": 9, "top_p": 0.8}
    runs = [
        forward_backward(
            lambda x, y, c=c: logprobs_and_entropy(x, y, **kw, chunk_size=c),
            (logits, target),
            grads,
        )
        for c in (1, 7, 64)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Forward only (the backward reuses the saved threshold), one chunk at a time: never [N, V].
    # The chunks may run on the thread pool in any order: compare the multisets.
    assert sorted(seen) == sorted([1] * 50 + [7] * 7 + [1] + [50])


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (6,), generator=gen)
    for kw in (
        {"top_k": 3},
        {"top_p": 0.6, "entropy_over_support": True},
        {"top_k": 5, "min_p": 0.05, "temperature": 0.7},
    ):

        def fn(t, kw=kw):
            return logprobs_and_entropy(t, y, **kw, chunk_size=4)

        assert torch.autograd.gradcheck(fn, (x,))
        assert torch.autograd.gradgradcheck(fn, (x,))


def test_without_entropy_and_entropy_grad_off():
    logits, target, grads = _data((9,), 21, seed=9)
    kw = {"top_k": 6, "top_p": 0.9}
    full = forward_backward(
        lambda x, y: logprobs_and_entropy(x, y, **kw), (logits, target), [grads[0], None]
    )
    lp, ent, g = forward_backward(
        lambda x, y: logprobs_and_entropy(x, y, **kw, with_entropy=False),
        (logits, target),
        [grads[0], None],
    )
    assert ent is None
    torch.testing.assert_close(lp, full[0], rtol=0, atol=0)
    torch.testing.assert_close(g, full[2], rtol=0, atol=0)
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, target, **kw, entropy_grad=False, entropy_over_support=True)
    assert lp.requires_grad and not ent.requires_grad


# --------------------------------------------------------------------------- fused linear
LINEAR_CASES = [
    {"top_k": 6},
    {"top_p": 0.7, "temperature": 0.8},
    {"top_k": 15, "top_p": 0.9, "min_p": 0.02, "temperature": 1.2},
    {"top_k": "t", "top_p": "t"},
]


@pytest.mark.parametrize("kw", LINEAR_CASES)
@pytest.mark.parametrize("over_support", [False, True])
def test_linear_matches_reference(kw, over_support):
    gen = torch.Generator().manual_seed(12)
    n, h, v = 37, 16, 83
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.7
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    per_token = {
        "top_k": torch.randint(1, 100, (n,), generator=gen),
        "top_p": torch.rand(n, generator=gen) * 0.9 + 0.05,
    }
    kw = {k: (per_token[k] if val == "t" else val) for k, val in kw.items()}
    tau = kw.get("temperature", 1.0)
    sampler = {k: kw[k] for k in SAMPLER_KEYS if k in kw}
    support = reference_support(hidden.double() @ weight.double().T, tau, **sampler)
    assert torch.equal(support, reference_support(hidden @ weight.T, tau, **sampler))

    def ref(x, w, y):
        return reference(x @ w.T, y, support, temperature=tau, over_support=over_support)

    with nan_filled_empty():
        fast = forward_backward(
            lambda x, w, y: linear_logprobs_and_entropy(
                x, w, y, **kw, entropy_over_support=over_support, chunk_size=10
            ),
            (hidden, weight, target),
            grads,
        )
    ref32 = forward_backward(ref, (hidden, weight, target), grads)
    exact = forward_backward(ref, (hidden.double(), weight.double(), target), grads)
    for k, what in enumerate(["logp", "entropy", "grad hidden", "grad weight"]):
        assert torch.isfinite(fast[k]).all(), what
        factor = FACTOR_FWD if k < 2 else FACTOR_GRAD
        assert_as_accurate(fast[k], ref32[k], exact[k], factor, what)


def test_linear_gradcheck_float64():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (5,), generator=gen)
    for kw in ({"top_k": 3}, {"top_p": 0.6, "entropy_over_support": True}):

        def fn(a, b, kw=kw):
            return linear_logprobs_and_entropy(a, b, y, **kw, chunk_size=2)

        assert torch.autograd.gradcheck(fn, (x, w))
        assert torch.autograd.gradgradcheck(fn, (x, w))


def test_linear_bad_inputs():
    x, w, y = torch.zeros(3, 4), torch.zeros(6, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"top_k must have shape \[...\] like hidden"):
        linear_logprobs_and_entropy(x, w, y, top_k=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"top_p must lie in"):
        linear_logprobs_and_entropy(x, w, y, top_p=2.0)
    with pytest.raises(ValueError, match="entropy_over_support=True needs"):
        linear_logprobs_and_entropy(x, w, y, entropy_over_support=True)


# --------------------------------------------------------------------------- errors, meta
BAD = [
    ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
    ({"top_p": 1.5}, ValueError, r"top_p must lie in \(0, 1\]"),
    ({"top_p": float("nan")}, ValueError, r"top_p must lie in \(0, 1\]"),
    ({"top_p": torch.tensor([0.5, 0.0])}, ValueError, r"top_p must lie in \(0, 1\]"),
    ({"top_p": torch.tensor([0.5, float("nan")])}, ValueError, r"top_p must lie in"),
    ({"top_p": "0.5"}, TypeError, "top_p must be a float"),
    ({"top_p": torch.tensor([1, 1])}, TypeError, "top_p must be a float or a floating"),
    ({"top_p": torch.tensor([0.5, 0.5, 0.5])}, ValueError, "top_p must have shape"),
    ({"top_k": 0}, ValueError, "top_k must be >= 1"),
    ({"top_k": -3}, ValueError, "top_k must be >= 1"),
    ({"top_k": torch.tensor([3, 0])}, ValueError, "top_k must be >= 1"),
    ({"top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"top_k": True}, TypeError, "top_k must be an int"),
    ({"top_k": torch.tensor([2.0, 1.0])}, TypeError, "top_k must be an int or an integer"),
    ({"top_k": torch.tensor([[2, 1]])}, ValueError, "top_k must have shape"),
    ({"min_p": -0.1}, ValueError, r"min_p must lie in \[0, 1\]"),
    ({"min_p": 1.1}, ValueError, r"min_p must lie in \[0, 1\]"),
    ({"min_p": torch.tensor([0.1, 2.0])}, ValueError, r"min_p must lie in \[0, 1\]"),
    ({"entropy_over_support": True}, ValueError, "entropy_over_support=True needs top_k"),
    ({"entropy_over_support": 1, "top_k": 2}, TypeError, "entropy_over_support must be a bool"),
    (
        {"top_k": 2, "keep_mask": torch.ones(2, 5, dtype=torch.bool)},
        ValueError,
        "keep_mask and top_k / top_p / min_p are exclusive",
    ),
    ({"top_k": torch.tensor([2, 2], device="meta")}, ValueError, "top_k is on meta"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_inputs(change, error, match):
    with pytest.raises(error, match=match):
        logprobs_and_entropy(torch.zeros(2, 5), torch.tensor([0, 4]), **change)


def test_meta_tensors_no_host_sync(monkeypatch):
    """Forward and backward on meta tensors (no values: any host read raises), same shapes and
    dtypes as on CPU."""
    monkeypatch.delenv("RLOPS_CHECK_VALUES", raising=False)
    n, v = (3, 8), 37
    for dtype in (torch.float32, torch.bfloat16):
        for kw in (
            {"top_k": 5},
            {"top_p": 0.7, "entropy_over_support": True},
            {"top_k": "t", "top_p": "t", "min_p": "t", "temperature": 0.7},
        ):
            outs = []
            for device in ("cpu", "meta"):

                def per_token(name, device=device):
                    if name == "top_k":
                        return torch.full(n, 4, dtype=torch.long, device=device)
                    return torch.full(n, 0.5 if name == "top_p" else 0.01, device=device)

                args = {k: (per_token(k) if val == "t" else val) for k, val in kw.items()}
                x = torch.zeros(*n, v, dtype=dtype, device=device, requires_grad=True)
                y = torch.zeros(n, dtype=torch.long, device=device)
                lp, ent = logprobs_and_entropy(x, y, **args, chunk_size=5)
                (lp.sum() + ent.sum()).backward()
                h = torch.zeros(n[0] * n[1], 6, dtype=dtype, device=device, requires_grad=True)
                w = torch.zeros(v, 6, dtype=dtype, device=device, requires_grad=True)
                flat = {
                    k: (a.reshape(-1) if isinstance(a, torch.Tensor) else a)
                    for k, a in args.items()
                }
                lp2, ent2 = linear_logprobs_and_entropy(h, w, y.reshape(-1), **flat, chunk_size=5)
                (lp2.sum() + ent2.sum()).backward()
                outs.append(
                    [(t.shape, t.dtype) for t in (lp, ent, x.grad, lp2, ent2, h.grad, w.grad)]
                )
            assert outs[0] == outs[1]


def test_saved_state_is_per_token():
    """Only per-token numbers are saved besides the inputs (the threshold among them)."""
    logits, target, _ = _data((40,), 100, seed=14)
    for kw, count in (
        ({"top_k": 5}, 6),
        ({"top_p": 0.5, "entropy_over_support": True}, 4),
        ({"top_k": 5, "with_entropy": False}, 3),
    ):
        x = logits.clone().requires_grad_()
        inputs = {x.data_ptr(), target.data_ptr()}
        sizes = []

        def pack(t, sizes=sizes, inputs=inputs):
            if t.data_ptr() not in inputs:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs_and_entropy(x, target, **kw)
        assert sizes == [40] * count, kw


TP_N, TP_V, TP_H = 23, 52, 6
TP_SIZES = (20, 32)  # unequal shards
TP_CASES = {
    "top_k": {"top_k": 5},
    "top_k top_p": {"top_k": 7, "top_p": 0.8, "temperature": 0.7, "chunk_size": 5},
    "min_p": {"min_p": 0.05, "chunk_size": 4},
    "all, per token, over support": {
        "top_k": 10,
        "top_p": "t",
        "min_p": 0.01,
        "entropy_over_support": True,
    },
    "ties": {"top_k": 4, "top_p": 0.6, "ints": True},
    "k > V_local": {"top_k": 30, "top_p": 0.95},
}


def _tp_case(name):
    kw = dict(TP_CASES[name])
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = torch.randn(TP_N, TP_V, generator=gen, dtype=torch.float64) * 3
    if kw.pop("ints", False):
        logits = logits.round()
    target = torch.randint(0, TP_V, (TP_N,), generator=gen)
    grads = [torch.randn(TP_N, generator=gen, dtype=torch.float64) for _ in range(2)]
    if kw.get("top_p") == "t":
        kw["top_p"] = torch.rand(TP_N, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    return logits, target, grads, kw


def _tp_linear():
    gen = torch.Generator().manual_seed(17)
    hidden = torch.randn(TP_N, TP_H, generator=gen, dtype=torch.float64)
    weight = torch.randn(TP_V, TP_H, generator=gen, dtype=torch.float64)
    target = torch.randint(0, TP_V, (TP_N,), generator=gen)
    grads = [torch.randn(TP_N, generator=gen, dtype=torch.float64) for _ in range(2)]
    bias = torch.randn(TP_V, generator=gen, dtype=torch.float64)
    return hidden, weight, bias, target, grads, {"top_k": 6, "top_p": 0.9, "chunk_size": 7}


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # the test compares the type and message on each rank
        return type(exc).__name__, str(exc)
    return None


def _tensor_parallel_sampler(rank, world):
    from tests._distributed import count_collectives

    group = dist.group.WORLD
    cols = slice(sum(TP_SIZES[:rank]), sum(TP_SIZES[: rank + 1]))
    out = {}
    for name in TP_CASES:
        logits, target, grads, kw = _tp_case(name)
        x = logits[:, cols].clone().requires_grad_()
        with count_collectives() as fwd:  # Σπ² too: no collective more
            lp, ent, sq = logprobs_and_entropy(x, target, group=group, with_sum_pi_squared=True,
                                               **kw)  # fmt: skip
        with count_collectives() as bwd:
            torch.autograd.backward([lp, ent], grads)
        out[name] = {
            "outs": (lp.detach(), ent.detach(), sq),
            "grad": x.grad,
            "fwd": sum(dict(fwd).values()),
            "bwd": sum(dict(bwd).values()),
        }
    hidden, weight, bias, target, grads, kw = _tp_linear()
    w = weight[cols].clone().requires_grad_()
    b = bias[cols].clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(hidden, w, target, bias=b, group=group, **kw)
    torch.autograd.backward([lp, ent], grads)
    out["linear"] = {"outs": (lp.detach(), ent.detach()), "grad": w.grad, "grad bias": b.grad}
    x = torch.zeros(3, TP_SIZES[rank], dtype=torch.float64)
    y = torch.zeros(3, dtype=torch.long)
    os.environ["RLOPS_TP_CHECK"] = "0"  # equal shards, the check off: 2 collectives
    logits, target, grads, kw = _tp_case("top_k top_p")
    half = TP_V // world
    xs = logits[:, rank * half : (rank + 1) * half].clone().requires_grad_()
    with count_collectives() as fwd:
        lp, ent = logprobs_and_entropy(xs, target, group=group, **kw)
    torch.autograd.backward([lp, ent], grads)
    out["unchecked"] = {
        "outs": (lp.detach(), ent.detach()),
        "grad": xs.grad,
        "fwd": sum(dict(fwd).values()),
    }
    del os.environ["RLOPS_TP_CHECK"]
    out["per-token top_k"] = logprobs_and_entropy(  # all tied: top-k = 1 keeps them all
        x, y, group=group, top_k=torch.ones(3, dtype=torch.long)
    )[0]
    out["top_p on rank 1"] = _raised(
        lambda: logprobs_and_entropy(x, y, group=group, **({"top_p": 0.5} if rank else {}))
    )
    out["top_k differs"] = _raised(lambda: logprobs_and_entropy(x, y, group=group, top_k=4 + rank))
    return out


@pytest.mark.distributed
def test_tensor_parallel_matches_one_process():
    """The vocabulary in two unequal shards: every rank's outputs and gradient shard equal the
    one-process results; the forward makes 3 collectives (check, candidates, statistics), the
    backward none; mismatched calls raise on every rank; ``Σπ²`` over the support (asked for in
    the same calls) too, and the bias gradient shard of the linear op. (Top-p without top-k and
    a per-token top-k, by radix select: tests/logprobs/test_sampler_radix.py.)"""
    res = run_distributed(_tensor_parallel_sampler, 2)
    for name in TP_CASES:
        logits, target, grads, kw = _tp_case(name)
        full = forward_backward(
            lambda x, y, kw=kw: logprobs_and_entropy(x, y, with_sum_pi_squared=True, **kw),
            (logits, target), [*grads, None],
        )  # fmt: skip
        for r, rank_res in enumerate(res):
            got = rank_res[name]
            cols = slice(sum(TP_SIZES[:r]), sum(TP_SIZES[: r + 1]))
            for a, b in zip(got["outs"], full[:3], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(got["grad"], full[3][:, cols], rtol=1e-12, atol=1e-12)
            assert got["fwd"] == 3 and got["bwd"] == 0, (name, got["fwd"], got["bwd"])
    hidden, weight, bias, target, grads, kw = _tp_linear()
    full = forward_backward(lambda h, w, b, y: linear_logprobs_and_entropy(h, w, y, bias=b, **kw),
                            (hidden, weight, bias, target), grads)  # fmt: skip
    for r, rank_res in enumerate(res):
        cols = slice(sum(TP_SIZES[:r]), sum(TP_SIZES[: r + 1]))
        for a, b in zip(rank_res["linear"]["outs"], full[:2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            rank_res["linear"]["grad"], full[3][cols], rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            rank_res["linear"]["grad bias"], full[4][cols], rtol=1e-12, atol=1e-12
        )
    logits, target, grads, kw = _tp_case("top_k top_p")
    full = forward_backward(lambda x, y: logprobs_and_entropy(x, y, **kw), (logits, target), grads)
    for r, rank_res in enumerate(res):
        got, half = rank_res["unchecked"], TP_V // len(res)
        for a, b in zip(got["outs"], full[:2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            got["grad"], full[2][:, r * half : (r + 1) * half], rtol=1e-12, atol=1e-12
        )
        assert got["fwd"] == 2
    for r in res:
        torch.testing.assert_close(
            r["per-token top_k"], torch.full((3,), -math.log(TP_V)), check_dtype=False
        )
        assert r["top_k differs"][0] == "ValueError"
        assert "`top_k`: [4, 5]" in r["top_k differs"][1]
        # top_p without top_k is supported: only rank 1 giving it is a mismatch of the check
        assert r["top_p on rank 1"][0] == "ValueError"
        assert "`top_p`: [None, 0.5]" in r["top_p on rank 1"][1]


def test_topk_and_sort_paths_agree():
    """A scalar top_k with top_p sorts only the k largest values (plus a count of the ties
    left out); a per-token top_k sorts the whole row: the same support."""
    gen = torch.Generator().manual_seed(16)
    for ints in (False, True):
        z = torch.randn(64, 200, generator=gen) * 3
        z = z.round() if ints else z
        for k, p, m in ((5, 0.9, None), (40, 0.5, 0.01), (150, 0.97, None), (1, 0.3, None)):
            a = support_chunk(z, k, p, m)
            b = support_chunk(z, torch.full((64, 1), k), p, m)
            assert torch.equal(a, b), (ints, k, p, m)


def test_huge_top_k_keeps_every_token():
    logits, target, _ = _data((4,), 30, seed=18)
    a = logprobs_and_entropy(logits, target, top_k=10**12, top_p=0.8)
    b = logprobs_and_entropy(logits, target, top_p=0.8)
    for u, w in zip(a, b, strict=True):
        torch.testing.assert_close(u, w, rtol=0, atol=0)


def test_vocab_layout_leaves_the_callers_sampler_as_it_is():
    """The whole vocabulary caps an int top_k in a new sampler; the given one is not modified."""
    target = torch.tensor([0, 9])
    sampler = _support.Sampler(100, 0.9, None)
    start, capped = _tp.vocab_layout(None, target, sampler, group=None, rank=0, world=1, v_local=10)
    assert start == 0
    assert (capped.top_k, capped.top_p, capped.min_p) == (10, 0.9, None)
    assert (sampler.top_k, sampler.top_p, sampler.min_p) == (100, 0.9, None)
    per_token = _support.Sampler(torch.tensor([3, 200]), None, None)
    assert (
        _tp.vocab_layout(None, target, per_token, group=None, rank=0, world=1, v_local=10)[1]
        is per_token
    )
    assert _tp.vocab_layout(None, target, None, group=None, rank=0, world=1, v_local=10) == (
        0,
        None,
    )
