"""DAPO's overlong penalty (``rlops.overlong_penalty``): against AReaL's own
``reward_overlong_penalty`` (copied below), the plain loop of ``rlops.advantages.reference``
and an exact rational oracle, for integer and floating lengths on odd sizes, by hand, under
autograd, and on bad input."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch
from tests._bad_input import names
from tests._losses_util import DTYPES, assert_within_ref_error, random_mask

import rlops
from rlops.advantages.reference import overlong_penalty_reference


# --------------------------------------------------------------------------- the peer's code
# areal-project/AReaL areal/utils/functional/functional.py at commit
# cbff54d645d2cd8ee1f1c358a82f3f473588433d: reward_overlong_penalty verbatim (`Any` from
# typing). Its penalty is a tensor in torch's default dtype (a long tensor divided by an int):
# the comparison runs it with float64 as the default dtype, so that it measures the formula,
# not float32 rounding.
def reward_overlong_penalty(
    data: dict[str, Any],
    overlong_tokens: int,
    overlong_penalty_factor: float,
    max_response_length: int,
) -> dict[str, Any]:
    reward_score = data["rewards"]
    input_ids = data["input_ids"]
    response_lengths = (data["loss_mask"].sum(dim=-1)).long()
    batch_size = input_ids.shape[0]
    for sample_idx in range(batch_size):
        reward_score_cur = reward_score[sample_idx]
        response_length_cur = response_lengths[sample_idx]
        expected_len = max_response_length - overlong_tokens
        exceed_len = response_length_cur - expected_len
        overlong_reward = min(-exceed_len / overlong_tokens * overlong_penalty_factor, 0)
        reward_score_cur += overlong_reward
        reward_score[sample_idx] = reward_score_cur

    data["rewards"] = reward_score
    return data


def _areal_penalty(mask, max_len, cache_len, factor):
    """AReaL's shaped reward minus the reward it started from (random, float64)."""
    b = mask.shape[0]
    rewards = torch.randn(b, generator=torch.Generator().manual_seed(b), dtype=torch.float64)
    data = {"rewards": rewards.clone(), "input_ids": torch.zeros_like(mask), "loss_mask": mask}
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = reward_overlong_penalty(data, cache_len, factor, max_len)["rewards"]
    finally:
        torch.set_default_dtype(before)
    return out, rewards


WORST: dict[str, float] = {}


@pytest.mark.parametrize("max_len,cache_len", [(40, 8), (40, 1), (40, 40), (33, 7)])
@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("b,seed", [(1, 0), (9, 1), (129, 2)])
def test_matches_areal(b, seed, max_len, cache_len, factor):
    """Responses up to 60 tokens (past max_len too), ragged masks, empty rows: AReaL's reward
    after shaping is the reward plus rlops's penalty."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, 60, gen)
    shaped, rewards = _areal_penalty(mask, max_len, cache_len, factor)
    penalty = rlops.overlong_penalty(mask.sum(-1), max_len, cache_len, factor)
    assert penalty.dtype == torch.get_default_dtype()
    ours = rewards + rlops.overlong_penalty(mask.sum(-1).double(), max_len, cache_len, factor)
    diff = float((ours - shaped).abs().max())
    WORST["areal"] = max(WORST.get("areal", 0.0), diff)
    assert diff <= 1e-12 * max(1.0, float(shaped.abs().max())), diff
    torch.testing.assert_close(penalty, (shaped - rewards).float(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the reference
def _exact(lengths, max_len, cache_len, factor):
    out = []
    for n in lengths.tolist():
        p = -(Fraction(n) - (max_len - cache_len)) / cache_len * Fraction(factor)
        out.append(float(min(p, Fraction(0))))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, *DTYPES])
@pytest.mark.parametrize("b", [1, 127, 128, 129, 1000])
def test_matches_reference_and_exact_oracle(dtype, b):
    gen = torch.Generator().manual_seed(b)
    lengths = torch.randint(0, 4097, (b,), generator=gen)
    if dtype.is_floating_point:
        lengths = (lengths + torch.rand(b, generator=gen)).to(dtype)  # fractional lengths
    else:
        lengths = lengths.to(dtype)
    out = rlops.overlong_penalty(lengths, 4096, 1024, 0.7)
    want_dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
    assert out.dtype == want_dtype and out.shape == (b,) and (out <= 0).all()
    same = overlong_penalty_reference(lengths, 4096, 1024, 0.7).to(want_dtype)
    assert_within_ref_error(out, _exact(lengths, 4096, 1024, 0.7), same)


# --------------------------------------------------------------------------- by hand, edges
def test_by_hand_linear_past_max_len():
    lengths = torch.tensor([0, 24, 25, 28, 32, 36, 64])
    out = rlops.overlong_penalty(lengths, max_len=32, cache_len=8, factor=2.0)
    assert out.tolist() == [0.0, 0.0, -0.25, -1.0, -2.0, -3.0, -10.0]
    assert not torch.signbit(out[:2]).any()  # +0, not −0
    assert rlops.overlong_penalty(lengths, 32, 8, factor=0.0).abs().max() == 0


def test_whole_response_interval_and_empty_batch():
    out = rlops.overlong_penalty(torch.tensor([0, 5, 10]), max_len=10, cache_len=10)
    assert out.tolist() == [0.0, -0.5, -1.0]
    assert rlops.overlong_penalty(torch.zeros(0, dtype=torch.long), 10, 2).shape == (0,)


def test_gradient_and_meta_tensors():
    lengths = torch.tensor([10.0, 30.0, 40.0], dtype=torch.float64, requires_grad=True)
    rlops.overlong_penalty(lengths, 32, 8).sum().backward()
    assert lengths.grad.tolist() == [0.0, -1 / 8, -1 / 8]
    meta = rlops.overlong_penalty(torch.empty(5, device="meta"), 32, 8)
    assert meta.shape == (5,) and meta.device.type == "meta"


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    lengths = torch.tensor([3, 5])
    call = rlops.overlong_penalty
    with pytest.raises(TypeError, match=names("lengths")):
        call([3, 5], 10, 2)
    with pytest.raises(TypeError, match=names("lengths")):
        call(lengths.bool(), 10, 2)
    with pytest.raises(ValueError, match=names("lengths")):
        call(lengths[:, None], 10, 2)
    with pytest.raises(ValueError, match=names("lengths")):
        call(torch.tensor([3, -1]), 10, 2)
    with pytest.raises(ValueError, match=names("lengths")):
        call(torch.tensor([3.0, float("nan")]), 10, 2)
    with pytest.raises(TypeError, match=names("max_len")):
        call(lengths, 10.0, 2)
    with pytest.raises(ValueError, match=names("max_len")):
        call(lengths, 0, 1)
    with pytest.raises(TypeError, match=names("cache_len")):
        call(lengths, 10, 2.5)
    with pytest.raises(ValueError, match=names("cache_len")):
        call(lengths, 10, 0)
    with pytest.raises(ValueError, match=names("cache_len")):
        call(lengths, 10, 11)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=names("factor")):
            call(lengths, 10, 2, bad)
