"""The fused ops under the sampler's filters (top-k, top-p, min-p) vs the unfused reference
(:mod:`rlops.logprobs.reference`), which builds the support on the full vocabulary; and that
reference's support vs the plain definition, token by token in Python floats.

Float32 and bfloat16: the fast op's error against the float64 reference is at most a small
factor of the same-precision reference's (bfloat16: the same values upcast). Float64: the same
rule against a ``numpy.longdouble`` oracle of the definitions.
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
from tests.logprobs.test_sampler import reference_support

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import (
    linear_logprobs_and_entropy_reference,
    logprobs_and_entropy_reference,
    sampler_keep_mask,
)

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0
V = 131
SIZES = [1, 127, 128, 129, 1000]
SAMPLER_KEYS = ("top_k", "top_p", "min_p")
# "t": a per-token tensor
CASES = {
    "top_k": {"top_k": 7},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.05},
    "top_k, top_p": {"top_k": 20, "top_p": 0.7},
    "all three": {"top_k": 30, "top_p": 0.9, "min_p": 0.02},
    "k >= V, p = 1": {"top_k": 500, "top_p": 1.0},
    "per token": {"top_k": "t", "top_p": "t", "min_p": "t"},
    "top_p per token, top_k": {"top_k": 12, "top_p": "t"},
}


def _params(kw: dict, shape: tuple[int, ...], gen: torch.Generator) -> dict:
    """``kw`` with every ``"t"`` replaced by a per-token tensor of ``shape`` (top-k some ≥ V,
    top-p some exactly 1, min-p some 0)."""
    per_token = {
        "top_k": torch.randint(1, V + 20, shape, generator=gen),
        "top_p": torch.where(
            torch.rand(shape, generator=gen) < 0.2,
            torch.ones(shape),
            torch.rand(shape, generator=gen) * 0.9 + 0.05,
        ),
        "min_p": torch.where(
            torch.rand(shape, generator=gen) < 0.2,
            torch.zeros(shape),
            torch.rand(shape, generator=gen) * 0.1,
        ),
    }
    return {k: (per_token[k] if v == "t" else v) for k, v in kw.items()}


def _data(n: int, case: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, V, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2)]
    return logits, target, grads, _params(CASES[case], (n,), gen)


# --------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ties", [False, True])
def test_reference_support_is_the_definition(case, ties):
    """:func:`sampler_keep_mask` equals the support stated token by token in Python floats."""
    logits, _, _, params = _data(40, case, seed=1)
    if ties:  # integer logits: ties at every threshold
        logits = logits.round()
    expected = reference_support(logits, **params)
    assert torch.equal(sampler_keep_mask(logits, **params), expected)


def test_reference_support_example_values():
    """Hand-computed supports of p = (0.5, 0.25, 0.15, 0.1), away from every boundary."""
    z = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]], dtype=torch.float64))
    expected = [
        ({"top_k": 1}, [True, False, False, False]),
        ({"top_k": 3}, [True, True, True, False]),
        ({"top_p": 0.45}, [True, False, False, False]),  # the mass before token 1: 0.5
        ({"top_p": 0.6}, [True, True, False, False]),  # before token 2: 0.75
        ({"top_p": 0.8}, [True, True, True, False]),
        ({"min_p": 0.25}, [True, True, True, False]),  # p ≥ 0.25 · 0.5 = 0.125
        ({"min_p": 0.31}, [True, True, False, False]),  # p ≥ 0.155
        # top-p on the top-3 renormalised (0.5, 0.25, 0.15) / 0.9: before token 2, 0.833
        ({"top_k": 3, "top_p": 0.7}, [True, True, False, False]),
        # min-p leaves (0.5, 0.25), renormalised: before token 1, 2/3 ≥ 0.6
        ({"min_p": 0.4, "top_p": 0.6}, [True, False, False, False]),
    ]
    for kw, keep in expected:
        assert sampler_keep_mask(z, **kw).tolist() == [keep], kw


# --------------------------------------------------------------------------- logits op
def _reference(over: bool, tau: float, params: dict):
    return lambda x, y: logprobs_and_entropy_reference(
        x, y, temperature=tau, entropy_over_support=over, **params
    )


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logits_op_matches_reference(n, case, dtype):
    logits64, target, grads, params = _data(n, case, seed=n)
    over = n % 2 == 1  # the entropy over the support on odd sizes, over everything on even
    tau = 0.8 if n != 128 else 1.0
    logits = logits64.to(dtype)
    ref = _reference(over, tau, params)

    def fast_fn(x, y):
        return logprobs_and_entropy(
            x, y, temperature=tau, entropy_over_support=over, chunk_size=50, **params
        )

    with nan_filled_empty():
        fast = forward_backward(fast_fn, (logits, target), grads)
    assert (
        fast[0].dtype
        == fast[1].dtype
        == (torch.float64 if dtype == torch.float64 else torch.float32)
    )
    assert fast[2].dtype == dtype
    whats = [("logp", FACTOR_FWD), ("entropy", FACTOR_FWD), ("grad", FACTOR_GRAD)]
    if dtype == torch.float64:
        ref64 = forward_backward(ref, (logits, target), grads)
        support = sampler_keep_mask(logits / tau, **params)
        oracle = longdouble_oracle(
            logits, target, support, grads, temperature=tau, over_support=over
        )
        for k, (what, factor) in enumerate(whats):
            assert_as_accurate_as_float64(fast[k], ref64[k], oracle[k], factor, what)
        return
    # Half inputs: the same values upcast; the float32 reference is the yardstick, its
    # gradient rounded to the input dtype.
    ref32 = forward_backward(ref, (logits.float(), target), grads)
    exact = forward_backward(ref, (logits.double(), target), grads)
    ref32[2] = ref32[2].to(dtype)
    for k, (what, factor) in enumerate(whats):
        assert torch.isfinite(fast[k]).all(), what
        assert_as_accurate(fast[k], ref32[k], exact[k], factor, what)


def test_reference_rejects_two_supports():
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="either as keep_mask"):
        logprobs_and_entropy_reference(x, y, keep_mask=torch.ones(2, 3, dtype=bool), top_k=1)
    with pytest.raises(ValueError, match="entropy_over_support"):
        logprobs_and_entropy_reference(x, y, entropy_over_support=True)


# --------------------------------------------------------------------------- linear op
@pytest.mark.parametrize("n", [1, 129, 1000])
@pytest.mark.parametrize("case", ["top_k", "top_p", "all three", "per token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_op_matches_reference(n, case, dtype):
    gen = torch.Generator().manual_seed(100 + n)
    h = 16
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, h, generator=gen, dtype=torch.float64) * 0.7).to(dtype)
    target = torch.randint(0, V, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2)]
    params = _params(CASES[case], (n,), gen)
    over = case == "top_p"
    tau = 0.9

    def fast_fn(x, w, y):
        return linear_logprobs_and_entropy(
            x, w, y, temperature=tau, entropy_over_support=over, chunk_size=60, **params
        )

    def ref(x, w, y):
        return linear_logprobs_and_entropy_reference(
            x, w, y, temperature=tau, entropy_over_support=over, **params
        )

    with nan_filled_empty():
        fast = forward_backward(fast_fn, (hidden, weight, target), grads)
    whats = [
        ("logp", FACTOR_FWD),
        ("entropy", FACTOR_FWD),
        ("grad hidden", FACTOR_GRAD),
        ("grad weight", FACTOR_GRAD),
    ]
    if dtype == torch.float64:
        ref64 = forward_backward(ref, (hidden, weight, target), grads)
        # the oracle on the float64 logits; the input gradients by the chain rule, in longdouble
        logits = hidden @ weight.T
        support = sampler_keep_mask(logits / tau, **params)
        lp, ent, g = longdouble_oracle(
            logits, target, support, grads, temperature=tau, over_support=over
        )
        h_ld, w_ld = hidden.numpy().astype(g.dtype), weight.numpy().astype(g.dtype)
        oracle = [lp, ent, g @ w_ld, g.T @ h_ld]
        for k, (what, factor) in enumerate(whats):
            assert_as_accurate_as_float64(fast[k], ref64[k], oracle[k], factor, what)
        return
    ref32 = forward_backward(ref, (hidden, weight, target), grads)
    exact = forward_backward(ref, (hidden.double(), weight.double(), target), grads)
    for k, (what, factor) in enumerate(whats):
        assert torch.isfinite(fast[k]).all(), what
        assert_as_accurate(fast[k], ref32[k], exact[k], factor, what)
