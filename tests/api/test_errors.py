"""Bad input raises ValueError or TypeError, and the message names the offending argument."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rlops import discounted_cumsum, discounted_returns, gae

B, T = 3, 8


def _x(dtype=torch.float32, device="cpu"):
    return (
        torch.randn(B, T, device=device).to(dtype)
        if device == "cpu"
        else torch.empty(B, T, dtype=dtype, device=device)
    )


BAD_UNIT = [1.5, -0.1, math.nan, math.inf, 1.0000001]


def names(arg: str) -> str:
    """A pattern for a message that names ``arg`` as a word (``x`` must not match ``expected``)."""
    return rf"\b{re.escape(arg)}\b"


# ------------------------------------------------------------------------- discounted_cumsum


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_cumsum_integer_x(dtype):
    with pytest.raises(TypeError, match=names("x")):
        discounted_cumsum(torch.ones(B, T, dtype=dtype), 0.9)


@pytest.mark.parametrize("x", [[[1.0, 2.0]], 1.0, None])
def test_cumsum_x_not_a_tensor(x):
    with pytest.raises(TypeError, match=names("x")):
        discounted_cumsum(x, 0.9)


@pytest.mark.parametrize("discount", BAD_UNIT)
def test_cumsum_discount_out_of_range(discount):
    with pytest.raises(ValueError, match=names("discount")):
        discounted_cumsum(_x(), discount)


@pytest.mark.parametrize("bad", BAD_UNIT)
@pytest.mark.parametrize("shape", [(B, T), (B, 1)])
def test_cumsum_discount_tensor_out_of_range(bad, shape):
    a = torch.full(shape, 0.9)
    a[-1, -1] = bad
    with pytest.raises(ValueError, match=names("discount")):
        discounted_cumsum(_x(), a)


@pytest.mark.parametrize("shape", [(B, T + 1), (B + 1, 1), (T,) * 3, (2, T)])
def test_cumsum_discount_not_broadcastable(shape):
    with pytest.raises(ValueError, match=names("discount")):
        discounted_cumsum(_x(), torch.full(shape, 0.5))


def test_cumsum_discount_complex():
    with pytest.raises(TypeError, match=names("discount")):
        discounted_cumsum(_x(), torch.full((B, T), 0.5, dtype=torch.complex64))


@pytest.mark.parametrize("discount", ["0.9", None, [0.9]])
def test_cumsum_discount_wrong_type(discount):
    with pytest.raises(TypeError, match=names("discount")):
        discounted_cumsum(_x(), discount)


def test_cumsum_discount_on_another_device():
    with pytest.raises(ValueError, match=names("discount")):
        discounted_cumsum(_x(), torch.full((B, T), 0.5, device="meta"))


@pytest.mark.parametrize("method", ["fast", "Chunked", "", None, "matrix"])
def test_cumsum_unknown_method(method):
    with pytest.raises(ValueError, match=names("method")):
        discounted_cumsum(_x(), 0.9, method=method)


@pytest.mark.parametrize("chunk_size", [0, -1, -64])
def test_cumsum_chunk_size_below_one(chunk_size):
    with pytest.raises(ValueError, match=names("chunk_size")):
        discounted_cumsum(_x(), 0.9, method="chunked", chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [2.5, 4.0, "4", True])
def test_cumsum_chunk_size_not_an_int(chunk_size):
    with pytest.raises(TypeError, match=names("chunk_size")):
        discounted_cumsum(_x(), 0.9, method="chunked", chunk_size=chunk_size)


@pytest.mark.parametrize("dim", [2, -3])
def test_cumsum_dim_out_of_range(dim):
    with pytest.raises(ValueError, match=names("dim")):
        discounted_cumsum(_x(), 0.9, dim=dim)


def test_compiled_needs_a_cpu_tensor():
    with pytest.raises(ValueError, match=r"(?i)cpu"):
        discounted_cumsum(_x(device="meta"), 0.9, method="compiled")


# ------------------------------------------------------------------- gae / discounted_returns


def _gae(**overrides):
    kw = {"rewards": _x(), "values": _x(), "gamma": 0.99, "lam": 0.95}
    kw.update(overrides)
    rewards, values = kw.pop("rewards"), kw.pop("values")
    return gae(rewards, values, **kw)


def _returns(**overrides):
    kw = {"rewards": _x(), "gamma": 0.99}
    kw.update(overrides)
    return discounted_returns(kw.pop("rewards"), **kw)


ESTIMATORS = {"gae": _gae, "discounted_returns": _returns}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_integer_rewards(estimator, dtype):
    with pytest.raises(TypeError, match=names("rewards")):
        ESTIMATORS[estimator](rewards=torch.ones(B, T, dtype=dtype))


def test_integer_values():
    with pytest.raises(TypeError, match=names("values")):
        _gae(values=torch.ones(B, T, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(B, T + 1), (B + 1, T), (B * T,), (B, T, 1)])
def test_values_shape_mismatch(shape):
    with pytest.raises(ValueError, match=names("values")):
        _gae(values=torch.zeros(shape))


@pytest.mark.parametrize("shape", [(T,), (B, T, 2)])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_rewards_not_2d(estimator, shape):
    kw = {"rewards": torch.zeros(shape)}
    if estimator == "gae":
        kw["values"] = torch.zeros(shape)
    with pytest.raises(ValueError, match=names("rewards")):
        ESTIMATORS[estimator](**kw)


@pytest.mark.parametrize("bad", BAD_UNIT)
@pytest.mark.parametrize("name", ["gamma", "lam"])
def test_gae_discounts_out_of_range(name, bad):
    with pytest.raises(ValueError, match=names(name)):
        _gae(**{name: bad})
    rows = torch.full((B,), 0.9)
    rows[1] = bad
    with pytest.raises(ValueError, match=names(name)):
        _gae(**{name: rows})


@pytest.mark.parametrize("bad", BAD_UNIT)
def test_returns_gamma_out_of_range(bad):
    with pytest.raises(ValueError, match=names("gamma")):
        _returns(gamma=bad)
    with pytest.raises(ValueError, match=names("gamma")):
        _returns(gamma=torch.tensor([0.9, bad, 0.9]))


@pytest.mark.parametrize("shape", [(B + 1,), (B, T), (1, B + 1)])
@pytest.mark.parametrize("name", ["gamma", "lam"])
def test_gae_per_row_discount_wrong_shape(name, shape):
    with pytest.raises(ValueError, match=names(name)):
        _gae(**{name: torch.full(shape, 0.9)})


@pytest.mark.parametrize("name", ["gamma", "lam"])
def test_gae_discount_wrong_type(name):
    with pytest.raises(TypeError, match=names(name)):
        _gae(**{name: "0.9"})
    with pytest.raises(TypeError, match=names(name)):
        _gae(**{name: torch.full((B,), 0.9, dtype=torch.complex64)})


@pytest.mark.parametrize("name", ["mask", "dones"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("shape", [(B, T + 1), (B + 1, T), (B * T,), (B, T, 1), (T, B)])
def test_indicator_wrong_shape(estimator, name, shape):
    with pytest.raises(ValueError, match=names(name)):
        ESTIMATORS[estimator](**{name: torch.ones(shape, dtype=torch.bool)})


@pytest.mark.parametrize("name", ["mask", "dones"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_indicator_complex(estimator, name):
    with pytest.raises(TypeError, match=names(name)):
        ESTIMATORS[estimator](**{name: torch.ones(B, T, dtype=torch.complex64)})


@pytest.mark.parametrize("name", ["mask", "dones"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("bad", [2, -1, 0.5])
def test_indicator_not_zero_one(estimator, name, bad):
    t = torch.ones(B, T)
    t[1, 2] = bad
    with pytest.raises(ValueError, match=names(name)):
        ESTIMATORS[estimator](**{name: t})


@pytest.mark.parametrize("name", ["mask", "dones"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_indicator_not_a_tensor(estimator, name):
    with pytest.raises(TypeError, match=names(name)):
        ESTIMATORS[estimator](**{name: [[1] * T] * B})


META = {
    "values": lambda: _x(device="meta"),
    "mask": lambda: torch.ones(B, T, dtype=torch.bool, device="meta"),
    "dones": lambda: torch.zeros(B, T, dtype=torch.bool, device="meta"),
    "gamma": lambda: torch.full((B,), 0.9, device="meta"),
    "lam": lambda: torch.full((B,), 0.9, device="meta"),
}


@pytest.mark.parametrize("name", list(META))
def test_gae_tensors_on_different_devices(name):
    with pytest.raises(ValueError, match=names(name)):
        _gae(**{name: META[name]()})


@pytest.mark.parametrize("name", ["mask", "dones", "gamma"])
def test_returns_tensors_on_different_devices(name):
    with pytest.raises(ValueError, match=names(name)):
        _returns(**{name: META[name]()})


@pytest.mark.parametrize("method", ["fast", "", None, "matrix"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_unknown_method(estimator, method):
    with pytest.raises(ValueError, match=names("method")):
        ESTIMATORS[estimator](method=method)


@pytest.mark.parametrize("chunk_size", [0, -1])
def test_gae_chunk_size_below_one(chunk_size):
    with pytest.raises(ValueError, match=names("chunk_size")):
        _gae(method="chunked", chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [2.5, "4", True])
def test_gae_chunk_size_not_an_int(chunk_size):
    with pytest.raises(TypeError, match=names("chunk_size")):
        _gae(method="chunked", chunk_size=chunk_size)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_compiled_needs_cpu_tensors(estimator):
    meta = torch.empty(B, T, device="meta")
    kw = {"rewards": meta}
    if estimator == "gae":
        kw["values"] = meta
    with pytest.raises(ValueError, match=r"(?i)cpu"):
        ESTIMATORS[estimator](method="compiled", **kw)
