"""The one-pass REINFORCE++ kernel (CPU, numba): the token rewards are built inside the scan.

Its values must be those of the two-step construction the other methods use (the KL-penalised
token reward with the outcome added on the last action token, then the discounted returns over
action tokens), bit for bit, and it must be taken exactly where ``auto`` picks the compiled
method (no grad, float32/float64/bfloat16, no zero discount, no context parallelism).
"""

from __future__ import annotations

import pytest
import torch
from tests.oracles import discounted_returns_oracle
from tests.tolerances import assert_within_reference, needs_numba

import rlops
from rlops.advantages import compiled

pytestmark = needs_numba


def _two_step(outcome, kl, mask, kl_coef, gamma, method):
    """The construction of the docstring, with the compiled per-token-reward scan."""
    dtype = torch.promote_types(outcome.dtype, kl.dtype)
    token_r = torch.where(mask, -kl_coef * kl.to(dtype), 0.0)
    t_len = kl.shape[1]
    last = (t_len - 1) - mask.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    score = torch.where(mask.any(-1), outcome.to(dtype), 0.0).unsqueeze(-1)
    token_r = token_r.scatter_add(1, last, score)
    return rlops.discounted_returns(token_r, gamma=gamma, mask=mask, method=method)


def _inputs(b, t_len, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    kl = torch.randn(b, t_len, generator=g, dtype=dtype)
    outcome = torch.randn(b, generator=g, dtype=dtype)
    mask = torch.rand(b, t_len, generator=g) < 0.7
    mask[0] = False  # no action token
    if b > 1:
        mask[1] = False
        mask[1, t_len // 2] = True  # a single action token
    return outcome, kl, mask


@pytest.fixture
def spy(monkeypatch):
    """The dtype of each call's KL reaching the fused kernel (the general path's or the plain
    call's own)."""
    calls = []
    for name in ("reinforce_returns_compiled", "reinforce_plain"):
        real = getattr(compiled, name)

        def wrapped(*args, real=real):
            calls.append(args[0].dtype)
            return real(*args)

        monkeypatch.setattr(compiled, name, wrapped)
    return calls


@pytest.mark.parametrize("t_len", [1, 2, 127, 128, 129, 1000])
@pytest.mark.parametrize("b", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.3, "per-row"])
def test_bitwise_the_two_step_construction(t_len, b, dtype, gamma, spy):
    outcome, kl, mask = _inputs(b, t_len, seed=t_len * 31 + b, dtype=dtype)
    if gamma == "per-row":
        gamma = torch.linspace(0.2, 1.0, b, dtype=torch.float64)
    for kl_coef in (0.0, 0.05, 1.7):
        got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=kl_coef, gamma=gamma)
        want = _two_step(outcome, kl, mask, kl_coef, gamma, "compiled")
        assert got.dtype == dtype
        assert torch.equal(got, want)
    assert spy == [dtype] * 3


def test_mixed_dtypes_promote_before_the_kernel(spy):
    outcome, kl, mask = _inputs(3, 50, seed=0, dtype=torch.float32)
    got = rlops.reinforce_plus_plus_returns(outcome.double(), kl, mask, kl_coef=0.1, gamma=0.9)
    want = _two_step(outcome.double(), kl, mask, 0.1, 0.9, "compiled")
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert spy == [torch.float64]


@pytest.mark.parametrize("case", ["reference", "chunked", "grad", "zero gamma", "zero row gamma"])
def test_other_routes_keep_the_two_step_construction(case, spy):
    outcome, kl, mask = _inputs(3, 40, seed=1, dtype=torch.float32)
    method, gamma = "auto", 0.9
    if case in ("reference", "chunked"):
        method = case
    elif case == "grad":
        kl.requires_grad_(True)
    elif case == "zero gamma":
        gamma = 0.0
    else:
        gamma = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    got = rlops.reinforce_plus_plus_returns(
        outcome, kl, mask, kl_coef=0.1, gamma=gamma, method=method
    )
    assert spy == []
    if case == "grad":
        got.sum().backward()
        assert kl.grad is not None
    want = _two_step(outcome, kl.detach(), mask, 0.1, gamma, "reference")
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_takes_the_kernel_with_the_two_step_roundings(spy):
    # the token reward rounded to bfloat16, then its sum with the outcome (bit for bit at
    # every size: tests/advantages/test_bf16_fused_kernels.py)
    outcome, kl, mask = _inputs(3, 40, seed=1, dtype=torch.bfloat16)
    got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.9)
    assert spy == [torch.bfloat16]
    assert torch.equal(got, _two_step(outcome, kl, mask, 0.1, 0.9, "compiled"))


def test_nan_kl_on_mask0_tokens_and_nan_outcome_on_empty_rows_stay_out(spy):
    # mask-0 tokens carry no reward and a row without action tokens has no outcome: what they
    # hold is selected away, never multiplied by 0
    outcome, kl, mask = _inputs(4, 64, seed=2, dtype=torch.float32)
    clean = kl.clone()
    kl[~mask] = float("nan")
    outcome[0] = float("inf")  # row 0 has no action token
    got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.95)
    outcome[0] = 0.0
    want = _two_step(outcome, clean, mask, 0.1, 0.95, "reference")
    assert spy == [torch.float32]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hand_computed_row():
    # actions at 0, 2, 3; token rewards -0.5 * kl = [-0.5, ., -1.0, -1.5], outcome 2.0 on t = 3
    kl = torch.tensor([[1.0, 9.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[True, False, True, True, False]])
    got = rlops.reinforce_plus_plus_returns(
        torch.tensor([2.0]), kl, mask, kl_coef=0.5, gamma=0.5, method="compiled"
    )
    # G3 = -1.5 + 2 = 0.5; G2 = -1 + 0.5 * 0.5 = -0.75; G0 = -0.5 + 0.5 * -0.75 = -0.875
    assert got.tolist() == [[-0.875, 0.0, -0.75, 0.5, 0.0]]


def test_long_float32_rows_as_accurate_as_the_chunked_form():
    outcome, kl, mask = _inputs(4, 32768, seed=3, dtype=torch.float32)
    kl = kl.abs() * 0.01
    kwargs = dict(kl_coef=0.1, gamma=0.999)
    token_r = torch.where(mask, -0.1 * kl.double(), 0.0)
    last = (mask.shape[1] - 1) - mask.flip(-1).to(torch.uint8).argmax(-1)
    rows = mask.any(-1)
    token_r[rows] = token_r[rows].scatter_add(1, last[rows, None], outcome[rows, None].double())
    oracle = discounted_returns_oracle(token_r, 0.999, mask=mask)
    got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kwargs)
    ref = rlops.reinforce_plus_plus_returns(outcome, kl, mask, method="reference", **kwargs)
    chunked = rlops.reinforce_plus_plus_returns(outcome, kl, mask, method="chunked", **kwargs)
    assert_within_reference("auto", got, oracle, ref, chunked_out=chunked)


def _right_padded(b, t_len, seed, dtype):
    """Rows of action tokens then padding (each row's last action token inside a tile, on a
    tile's last or first token, or none), the common layout of a batch of responses; rows 1
    and 2 with rewards of zeros of both signs, so that their carries reach -0.0 by underflow
    under a tiny discount."""
    g = torch.Generator().manual_seed(seed)
    kl = torch.randn(b, t_len, generator=g, dtype=torch.float32).to(dtype)
    kl[1:3] = torch.where(torch.arange(t_len) % 3 == 0, -0.0, 0.0).to(dtype)
    outcome = torch.randn(b, generator=g, dtype=torch.float32).to(dtype)
    outcome[0] = -0.0
    ends = [t_len, t_len - 1, 16 * (t_len // 32), 16 * (t_len // 32) + 1, 0, 1, t_len // 2]
    lengths = torch.tensor([ends[i % len(ends)] for i in range(b)])
    return outcome, kl, torch.arange(t_len) < lengths[:, None]


@pytest.mark.parametrize("t_len", [16, 160, 1043, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("gamma", [1.0, 0.97, 1e-30])
def test_tiles_of_action_tokens_alone_give_the_two_step_bits(t_len, dtype, gamma, spy):
    # tiles where every row's token acts take a step of their own (no mask selects), the
    # outcome added on their first token while it is pending; the others the masked step
    outcome, kl, mask = _right_padded(11, t_len, seed=t_len, dtype=dtype)
    for full in (False, True):
        m = torch.ones_like(mask) if full else mask
        got = rlops.reinforce_plus_plus_returns(outcome, kl, m, kl_coef=0.3, gamma=gamma)
        assert torch.equal(got, _two_step(outcome, kl, m, 0.3, gamma, "compiled"))
    assert spy == [dtype] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_action_tiles_split_in_time_give_the_bits_of_one_thread(dtype, monkeypatch):
    # the pieces walk the tiles after theirs for the carries alone, on the same steps: the
    # rows' bits (the sign of a zero too) are those of one thread's pass
    from rlops.scan import compiled as scan_compiled

    monkeypatch.setattr(scan_compiled, "_MIN_ELEMENTS_PER_PIECE", 1 << 12)
    monkeypatch.setattr(scan_compiled, "_MIN_ELEMENTS_PER_THREAD", 1 << 12)
    scan_compiled._shares.cache_clear()
    outcome, kl, mask = _right_padded(8, 8195, seed=5, dtype=dtype)
    before = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out[threads] = [
                rlops.reinforce_plus_plus_returns(outcome, kl, m, kl_coef=0.3, gamma=gamma)
                for m in (mask, torch.ones_like(mask))
                for gamma in (0.97, 1e-30)
            ]
    finally:
        torch.set_num_threads(before)
        scan_compiled._shares.cache_clear()
    for a, b in zip(out[1], out[2], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
