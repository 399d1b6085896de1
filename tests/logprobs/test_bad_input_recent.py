"""Bad input to ``with_sum_pi_squared=`` on both log-prob ops and ``bias=`` on the linear one:
a ValueError / TypeError whose message names the argument and what it accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._bad_input import names

from rlops import linear_logprobs_and_entropy, logprobs_and_entropy

N, H, V = 5, 4, 7


def inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(N, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (N,), generator=g),
    )


def fused(**kw):
    hidden, weight, target = inputs()
    return logprobs_and_entropy(hidden @ weight.T, target, **kw)


def linear(**kw):
    return linear_logprobs_and_entropy(*inputs(), **kw)


@pytest.mark.parametrize("fn", [fused, linear], ids=["logprobs", "linear"])
@pytest.mark.parametrize(
    "bad",
    ["yes", 1, 0, None, np.bool_(True), torch.tensor(True)],
    ids=lambda v: f"{type(v).__name__}-{v}",
)
def test_with_sum_pi_squared_must_be_a_bool(fn, bad):
    with pytest.raises(TypeError, match=r"\bwith_sum_pi_squared must be a bool\b"):
        fn(with_sum_pi_squared=bad)


DTYPE = "hidden's dtype torch.float32"
BAD_BIAS = [
    (torch.zeros(V, dtype=torch.long), TypeError, DTYPE),
    (torch.zeros(V, dtype=torch.bool), TypeError, DTYPE),
    (torch.zeros(V, dtype=torch.float64), TypeError, DTYPE),
    (torch.zeros(V, dtype=torch.bfloat16), TypeError, DTYPE),
    (torch.zeros(V, dtype=torch.complex64), TypeError, DTYPE),
    (torch.zeros(V - 1), ValueError, "[V_local]"),
    (torch.zeros(V + 1), ValueError, "[7]"),
    (torch.zeros(1, V), ValueError, "[V_local]"),
    (torch.tensor(0.0), ValueError, "[V_local]"),
    ([0.0] * V, TypeError, "torch.Tensor or None"),
    (0.0, TypeError, "torch.Tensor or None"),
    (torch.zeros(V, device="meta"), ValueError, "one device"),
]


@pytest.mark.parametrize(
    ("bias", "exc", "words"), BAD_BIAS, ids=[f"{i}" for i in range(len(BAD_BIAS))]
)
def test_bad_bias_raises_naming_it(bias, exc, words):
    with pytest.raises(exc, match=names("bias")) as info:
        linear(bias=bias)
    assert words in str(info.value)


def test_nan_bias_entry_reaches_every_log_prob():
    # a NaN bias entry is data: every token's log-sum-exp reads it, so every log-prob is NaN
    bias = torch.zeros(V)
    bias[3] = float("nan")
    logp, _ = linear(bias=bias)
    assert logp.isnan().all()


def test_valid_values_run():
    for fn in (fused, linear):
        _, _, spp = fn(with_sum_pi_squared=True)
        assert torch.isfinite(spp).all() and ((spp > 0) & (spp <= 1)).all()
    logp, _ = linear(bias=torch.zeros(V))
    torch.testing.assert_close(logp, fused()[0])
