"""The log-prob ops' keyword options: one declaration (:class:`rlops.logprobs.LogprobOptions`)
for both ops and the linear reference; a misspelt keyword is a ``TypeError`` naming it, never a
silently ignored option, and the documented defaults are the ones the ops use."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

import rlops
from rlops.logprobs import LogprobOptions
from rlops.logprobs._options import Options
from rlops.logprobs.reference import (
    linear_logprobs_and_entropy_reference,
    logprobs_and_entropy_reference,
)

_H = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
_W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
_T = torch.tensor([0, 1, 2])


def _calls():
    return {
        "logprobs_and_entropy": lambda **kw: rlops.logprobs_and_entropy(_H @ _W.T, _T, **kw),
        "linear_logprobs_and_entropy": lambda **kw: rlops.linear_logprobs_and_entropy(
            _H, _W, _T, **kw
        ),
    }


@pytest.mark.parametrize("name", sorted(_calls()))
def test_misspelt_keyword_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=rf"{name}\(\).*temprature"):
        _calls()[name](temprature=2.0)


def test_linear_reference_misspelt_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="temprature"):
        linear_logprobs_and_entropy_reference(_H, _W, _T, temprature=2.0)


def test_the_documented_defaults_are_the_ops():
    """LogprobOptions' docstring: temperature 1, logit_scale 1, entropy_over_support False,
    entropy_grad True, every other option None; the keys are the op's options but the two
    output switches."""
    documented = {
        "temperature": 1.0,
        "logit_scale": 1.0,
        "entropy_over_support": False,
        "entropy_grad": True,
    }
    keys = set(LogprobOptions.__annotations__)
    assert keys == {f.name for f in fields(Options)} - {"with_entropy", "with_sum_pi_squared"}
    for f in fields(Options):
        if f.name in keys:
            assert f.default == documented.get(f.name), f.name


@pytest.mark.parametrize("name", sorted(_calls()))
def test_options_reach_the_op(name):
    """temperature, top_k and mask reach the op, on hand-computed values: the row
    [1, 0, 0.5] of logits at temperature 2 is [0.5, 0, 0.25], log-softmax of the target 0:
    0.5 − log(e^0.5 + 1 + e^0.25)."""
    logp, _ = _calls()[name](temperature=2.0)
    z = [0.5, 0.0, 0.25]
    expected = z[0] - math.log(sum(math.exp(v) for v in z))
    assert logp[0].item() == pytest.approx(expected, abs=1e-6)
    logp, _ = _calls()[name](top_k=1)  # the target is each row's argmax but row 2's
    assert logp[0].item() == 0.0 and logp[1].item() == 0.0
    logp, ent = _calls()[name](mask=torch.tensor([True, False, True]))
    assert logp[1].item() == 0.0 and ent[1].item() == 0.0


def test_linear_reference_forwards_its_options():
    """The linear reference is the logits reference on F.linear(hidden, weight, bias)."""
    b = torch.tensor([0.1, -0.2, 0.3])
    got = linear_logprobs_and_entropy_reference(
        _H, _W, _T, bias=b, temperature=0.7, top_p=0.9, with_sum_pi_squared=True
    )
    want = logprobs_and_entropy_reference(
        _H @ _W.T + b, _T, temperature=0.7, top_p=0.9, with_sum_pi_squared=True
    )
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
