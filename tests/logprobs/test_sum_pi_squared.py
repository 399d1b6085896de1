"""``with_sum_pi_squared=True``: ``Σ_v π_v²`` of the log-prob's distribution, in one process.

``π`` is the softmax of ``z = logits / τ`` over the support of the log-prob (the keep mask or
the sampler's, the target always in it; the whole vocabulary without one). Checked against the
definition: float32 and bfloat16 results within twice the same-dtype reference's error against
float64, float64 results within twice the float64 reference's error against a ``longdouble``
oracle; the identity ``τ²·‖∂logp/∂logits‖² = 1 − 2π_y + Σ_v π_v²``; bounds that hold for any
distribution (hypothesis); the output without gradient; the other outputs unchanged by the
flag. Vocabulary-parallel: tests/logprobs/test_tensor_parallel.py; Triton:
tests/logprobs/test_triton.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._logprobs_util import (
    assert_as_accurate,
    assert_as_accurate_as_float64,
    nan_filled_empty,
    sum_pi_squared_oracle,
)

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import linear_logprobs_and_entropy_reference as linear_reference
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import sampler_keep_mask

FACTOR = 2.0
# Rows per case: the same-dtype reference's error is the yardstick, and its max over a few dozen
# rows is one row's luck (measured over 2000 rows the two errors have the same mean and max).
ROWS = 257


def _data(n, v, *, seed, dtype=torch.float32, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    return logits, target, gen


# name -> the op's keywords; "keep": a keep mask of that density; "per-token top_k": a tensor
CASES = {
    "plain": {},
    "temperature and chunks": {"temperature": 0.7, "chunk_size": 7},
    "keep mask, chunks of three": {"keep": 0.3, "chunk_size": 3, "temperature": 1.3},
    "keep mask, no entropy": {"keep": 0.5, "with_entropy": False},
    "top_k": {"top_k": 5, "temperature": 1.3, "chunk_size": 16},
    "top_p over the support": {"top_p": 0.8, "entropy_over_support": True, "chunk_size": 16},
    "min_p": {"min_p": 0.05},
    "per-token top_k and top_p": {"per-token top_k": True, "top_p": 0.9},
}


def _keywords(name, logits, target, gen):
    kw = dict(CASES[name])
    n, v = logits.shape
    if "keep" in kw:
        kw["keep_mask"] = torch.rand(n, v, generator=gen) < kw.pop("keep")
        kw["keep_mask"].scatter_(1, target[:, None], False)  # the op keeps the target itself
    if kw.pop("per-token top_k", False):
        kw["top_k"] = torch.randint(1, v + 3, (n,), generator=gen)
    return kw


def _support(logits, kw):
    """The support as a mask (None: the whole vocabulary): the keep mask, or the sampler's,
    derived as the op does on the scaled logits in the compute dtype."""
    sampler = {k: kw[k] for k in ("top_k", "top_p", "min_p") if k in kw}
    if not sampler:
        return kw.get("keep_mask")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return sampler_keep_mask(logits.to(acc) / kw.get("temperature", 1.0), **sampler)


def _reference_sq(logits, target, support, temperature):
    return reference(logits, target, temperature=temperature, keep_mask=support,
                     with_entropy=False, with_sum_pi_squared=True)[2]  # fmt: skip


SAMPLED = ("top_k", "top_p over the support", "min_p", "per-token top_k and top_p")
PARAMS = [
    (name, v, dtype)
    for name in CASES
    for v in ((1, 129, 1000) if name in SAMPLED else (1, 127, 128, 129, 1000))
    for dtype in (torch.float32, torch.float64, torch.bfloat16)
]


@pytest.mark.parametrize(
    ("name", "v", "dtype"), PARAMS, ids=[f"{n}-{v}-{str(d)[6:]}" for n, v, d in PARAMS]
)
def test_matches_the_definition(name, v, dtype):
    logits, target, gen = _data(ROWS, v, seed=v + len(name), dtype=dtype)
    kw = _keywords(name, logits, target, gen)
    with nan_filled_empty():
        out = logprobs_and_entropy(logits, target, with_sum_pi_squared=True, **kw)
    assert len(out) == 3
    sq = out[2]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert sq.dtype == acc and sq.shape == target.shape
    # the flag changes nothing else
    plain = logprobs_and_entropy(logits, target, **kw)
    for a, b in zip(out[:2], plain, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    support, tau = _support(logits, kw), kw.get("temperature", 1.0)
    ref = _reference_sq(logits, target, support, tau)
    if dtype == torch.float64:
        oracle = sum_pi_squared_oracle(logits, target, support, tau)
        assert_as_accurate_as_float64(sq, ref, oracle, FACTOR, name)
    else:
        exact = _reference_sq(logits.double(), target, support, tau)
        assert_as_accurate(sq, ref, exact, FACTOR, name)


def test_hand_computed():
    """Four equal logits: 1/4; one of them kept with the target: 1/2; logits (log 3, 0, −∞):
    π = (3/4, 1/4, 0), 9/16 + 1/16 = 5/8."""
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [float(np.log(3.0)), 0.0, float("-inf"), float("-inf")],
        ]
    )
    keep = torch.tensor([[True] * 4, [False, True, False, False], [True] * 4])
    sq = logprobs_and_entropy(logits, torch.tensor([0, 0, 1]), keep_mask=keep,
                              with_sum_pi_squared=True)[2]  # fmt: skip
    torch.testing.assert_close(sq, torch.tensor([0.25, 0.5, 0.625]))


@pytest.mark.parametrize(
    "kw",
    [{}, {"temperature": 0.6, "chunk_size": 4}, {"keep": 0.4}, {"top_p": 0.7, "temperature": 1.4}],
)
def test_squared_norm_of_the_logprob_gradient(kw):
    """``‖∂logp/∂z‖² = ‖onehot − π‖² = 1 − 2π_y + Σπ²``, ``z = logits / τ``: the gradient of
    ``logp`` w.r.t. the logits, times τ, from the op's own backward (float64)."""
    logits, target, gen = _data(29, 211, seed=3, dtype=torch.float64)
    kw = dict(kw)
    if "keep" in kw:
        kw["keep_mask"] = torch.rand(29, 211, generator=gen) < kw.pop("keep")
    x = logits.clone().requires_grad_()
    logp, _, sq = logprobs_and_entropy(x, target, with_sum_pi_squared=True, **kw)
    (g,) = torch.autograd.grad(logp.sum(), x)  # row i depends on logits[i] only
    norm2 = (g * kw.get("temperature", 1.0)).pow(2).sum(dim=1)
    torch.testing.assert_close(norm2, 1 - 2 * logp.detach().exp() + sq, rtol=1e-12, atol=1e-12)


def test_no_gradient_and_the_other_gradients_unchanged():
    """A constant weight: no gradient flows through it, and asking for it leaves the gradients
    of ``logp`` and the entropy bit for bit as they were."""
    logits, target, gen = _data(23, 150, seed=4)
    g_lp, g_ent = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    grads = []
    for flag in (False, True):
        x = logits.clone().requires_grad_()
        out = logprobs_and_entropy(x, target, temperature=0.9, with_sum_pi_squared=flag)
        if flag:
            assert not out[2].requires_grad and out[2].grad_fn is None
        torch.autograd.backward([out[0], out[1]], [g_lp, g_ent])
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    x = logits.clone().requires_grad_()
    _, _, sq = logprobs_and_entropy(x, target, with_entropy=False, with_sum_pi_squared=True)
    assert not sq.requires_grad


def test_leading_dims_empty_and_minus_inf():
    logits, target, _ = _data(12, 40, seed=5)
    a = logprobs_and_entropy(logits.view(3, 4, 40), target.view(3, 4), with_sum_pi_squared=True)
    b = logprobs_and_entropy(logits, target, with_sum_pi_squared=True)
    assert a[2].shape == (3, 4)
    assert torch.equal(a[2].reshape(-1), b[2])
    empty = logprobs_and_entropy(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long),
                                 with_sum_pi_squared=True)  # fmt: skip
    assert empty[2].shape == (0,)
    # -inf logits: probability 0, the value of the finite logits alone
    wide = torch.cat([logits, torch.full((12, 9), float("-inf"))], dim=1)
    torch.testing.assert_close(logprobs_and_entropy(wide, target, with_sum_pi_squared=True)[2],
                               b[2], rtol=0, atol=0)  # fmt: skip


def test_large_logits_do_not_overflow():
    """Logits around 1e4: the statistics are relative to the row max."""
    logits, target, _ = _data(9, 300, seed=6, dtype=torch.float64, scale=10.0)
    logits = logits + 1e4
    sq = logprobs_and_entropy(logits, target, with_sum_pi_squared=True, chunk_size=4)[2]
    oracle = sum_pi_squared_oracle(logits, target, None, 1.0)
    ref = _reference_sq(logits, target, None, 1.0)
    assert_as_accurate_as_float64(sq, ref, oracle, FACTOR, "logits + 1e4")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    v=st.integers(1, 70),
    scale=st.floats(0.0, 30.0),
    keep_frac=st.sampled_from([None, 0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_bounds(n, v, scale, keep_frac, seed):
    """For any distribution over ``K`` (``|K|`` tokens): ``1/|K| ≤ Σπ² ≤ 1`` (Cauchy-Schwarz),
    ``Σπ² ≥ π_y²`` and ``Σπ² ≥ max_v π_v²``."""
    logits, target, gen = _data(n, v, seed=seed, dtype=torch.float64, scale=scale)
    keep = None if keep_frac is None else torch.rand(n, v, generator=gen) < keep_frac
    logp, _, sq = logprobs_and_entropy(logits, target, keep_mask=keep, with_sum_pi_squared=True)
    k = torch.full((n,), v) if keep is None else keep.scatter(1, target[:, None], True).sum(1)
    tol = 1e-12
    assert (sq <= 1 + tol).all() and (sq * k >= 1 - tol).all()
    assert (sq >= logp.exp() ** 2 - tol).all()


def test_linear_op_with_bias():
    """The fused output layer gives the same ``Σπ²`` as the reference on ``F.linear`` logits,
    with a keep mask, a temperature and chunks."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(31, 12, generator=gen)
    weight = torch.randn(129, 12, generator=gen) / 2
    bias = torch.randn(129, generator=gen)
    target = torch.randint(0, 129, (31,), generator=gen)
    keep = torch.rand(31, 129, generator=gen) < 0.5
    for kw in ({}, {"keep_mask": keep, "temperature": 0.8}):
        out = linear_logprobs_and_entropy(hidden, weight, target, bias=bias, chunk_size=5,
                                          with_sum_pi_squared=True, **kw)  # fmt: skip
        args = (hidden, weight, target)
        ref = linear_reference(*args, bias=bias, with_sum_pi_squared=True, **kw)
        exact = linear_reference(*(a.double() if a.is_floating_point() else a for a in args),
                                 bias=bias.double(), with_sum_pi_squared=True, **kw)  # fmt: skip
        assert_as_accurate(out[2], ref[2], exact[2], FACTOR, f"linear {sorted(kw)}")
        assert not out[2].requires_grad


def _bool_flag_call(name, **kw):
    """``with_sum_pi_squared=`` and the rest on either op (``name``: "logprobs" or "linear")."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 4, generator=gen), torch.randn(7, 4, generator=gen)
    target = torch.randint(0, 7, (5,), generator=gen)
    if name == "logprobs":
        return logprobs_and_entropy(hidden @ weight.T, target, **kw)
    return linear_logprobs_and_entropy(hidden, weight, target, **kw)


@pytest.mark.parametrize("name", ["logprobs", "linear"])
@pytest.mark.parametrize(
    "bad",
    ["yes", "y", 1, 0, None, np.bool_(True), torch.tensor(True)],
    ids=lambda v: f"{type(v).__name__}-{v}",
)
def test_flag_must_be_a_bool(name, bad):
    with pytest.raises(TypeError, match=r"\bwith_sum_pi_squared must be a bool\b"):
        _bool_flag_call(name, with_sum_pi_squared=bad)


@pytest.mark.parametrize("name", ["logprobs", "linear"])
def test_valid_flag_runs(name):
    _, _, spp = _bool_flag_call(name, with_sum_pi_squared=True)
    assert torch.isfinite(spp).all() and ((spp > 0) & (spp <= 1)).all()
