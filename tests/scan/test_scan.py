"""``rlops.discounted_cumsum``: every method against the oracle.

The oracle is the serial loop in extended precision (float64 where no wider type exists).
Accuracy rule (``tests/tolerances.py``): in float32 and float64 a method's max abs error is at
most twice the serial reference's own error on the same inputs plus a few ulps of the output's
magnitude; bfloat16/float16 outputs match the float32 serial reference rounded to their dtype
within one ulp (plus the float32 budget); the reference itself is held to the serial loop's
a priori error bound.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch
from tests.oracles import EXTENDED, discounted_cumsum_oracle, reversed_cumsum_oracle
from tests.tolerances import (
    FAST_METHODS,
    METHODS,
    assert_half_matches,
    assert_within_bound,
    assert_within_reference,
    for_each_method,
    needs_numba,
    serial_bound,
)

from rlops import discounted_cumsum

DISCOUNTS = [0.0, 0.5, 0.9405, 0.99, 1.0]
LENGTHS = [1, 127, 128, 129, 1000, 4097]
BATCHES = [1, 3]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
HALF = (torch.bfloat16, torch.float16)
KINDS = ["scalar", "row", "token"]


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def make_discount(kind, d, shape, dtype, gen):
    """A discount of the given kind around ``d``, broadcastable to ``shape`` (time last).

    ``row``: one value per row, ``d`` scaled down by up to 10% across rows. ``token``: ``d`` on
    most tokens, random dips on ~10% and exact zeros (episode ends) on ~2%.
    """
    if kind == "scalar":
        return d
    if kind == "row":
        rows = shape[0]
        scale = 1 - 0.1 * torch.arange(rows, dtype=torch.float64) / max(rows, 1)
        return (d * scale).reshape(rows, *([1] * (len(shape) - 1))).to(dtype)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    a = torch.full(shape, d, dtype=torch.float64)
    a = torch.where(u < 0.1, d * torch.rand(shape, generator=gen, dtype=torch.float64), a)
    a = torch.where(u < 0.02, 0.0, a)
    return a.to(dtype)


def _full(dtype):
    return torch.float32 if dtype in HALF else dtype


@functools.lru_cache(maxsize=32)
def scan_case(B, T, dtype_name, kind, d):
    """Inputs, float64 oracle and the serial reference's output (float32 for half dtypes)."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(_seed(B, T, dtype_name, kind, d))
    x = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)
    a = make_discount(kind, d, (B, T), dtype, gen)
    oracle = discounted_cumsum_oracle(x, a, extended=EXTENDED)
    a_full = a.to(_full(dtype)) if isinstance(a, torch.Tensor) else a
    ref = discounted_cumsum(x.to(_full(dtype)), a_full, method="reference")
    return x, a, oracle, ref


def check_output(name, out, x, a, oracle, ref, method, dim=-1):
    """The accuracy rule for one output of ``method`` (see the module docstring)."""
    assert out.dtype == x.dtype, f"{name}: dtype {out.dtype}, expected {x.dtype}"
    assert out.shape == x.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(x.shape)}"
    assert out.device == x.device
    if x.dtype in HALF:
        assert_half_matches(name, out, ref, oracle)
    elif method == "reference" or (x.dtype == torch.float64 and not EXTENDED):
        abs_oracle = discounted_cumsum_oracle(x.abs(), a, dim, extended=EXTENDED)
        bound = serial_bound(x.shape[dim], x.dtype, abs_oracle)
        assert_within_bound(f"{name} (a priori bound of the serial loop)", out, oracle, bound)
    else:
        chunked = None
        if method in ("compiled", "auto"):
            chunked = discounted_cumsum(x, a, dim=dim, method="chunked")
        assert_within_reference(name, out, oracle, ref, chunked_out=chunked)


GRID = [
    pytest.param((B, T, dt, kind, d), id=f"{dt}-{kind}-{d}-T{T}-B{B}")
    for dt, kind, d, T, B in itertools.product(DTYPES, KINDS, DISCOUNTS, LENGTHS, BATCHES)
]


@pytest.mark.parametrize("case", GRID)
def test_matches_oracle(case):
    x, a, oracle, ref = scan_case(*case)

    def check(method):
        out = discounted_cumsum(x, a, method=method)
        check_output(str(case), out, x, a, oracle, ref, method)

    for_each_method(check)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("d", [0.0, 0.9405, 1.0])
@pytest.mark.parametrize("kind", ["scalar", "token"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_chunk_sizes(dtype_name, kind, d, T, chunk_size):
    x, a, oracle, ref = scan_case(3, T, dtype_name, kind, d)
    out = discounted_cumsum(x, a, method="chunked", chunk_size=chunk_size)
    check_output(f"chunk_size={chunk_size}", out, x, a, oracle, ref, "chunked")


@pytest.mark.parametrize("method", FAST_METHODS)
def test_chunk_size_accepted_by_every_method(method):
    x, a, oracle, ref = scan_case(3, 1000, "float32", "token", 0.99)
    out = discounted_cumsum(x, a, method=method, chunk_size=7)
    check_output(method, out, x, a, oracle, ref, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_discount_zero_is_identity(method, dtype):
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    for a in (0.0, 0, torch.zeros(3, 1, dtype=dtype), torch.zeros(3, 300, dtype=dtype)):
        y = discounted_cumsum(x, a, method=method)
        assert y.dtype == dtype
        assert torch.equal(y, x), f"discount {a!r}: y != x"


@pytest.mark.parametrize("method", METHODS)
def test_integer_discounts_equal_floats(method):
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(1))
    for d in (0, 1):
        assert torch.equal(
            discounted_cumsum(x, d, method=method), discounted_cumsum(x, float(d), method=method)
        )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("T", [1, 129, 1000])
@pytest.mark.parametrize("d", [0.9405, 1.0])
def test_float16(method, T, d):
    gen = torch.Generator().manual_seed(_seed("f16", T, d))
    x = torch.randn(3, T, generator=gen).half()
    for kind in KINDS:
        a = make_discount(kind, d, (3, T), torch.float16, gen)
        a32 = a.float() if isinstance(a, torch.Tensor) else a
        oracle = discounted_cumsum_oracle(x, a, extended=EXTENDED)
        ref = discounted_cumsum(x.float(), a32, method="reference")
        out = discounted_cumsum(x, a, method=method)
        check_output(f"float16 {kind}", out, x, a, oracle, ref, method)


def _run_dim_case(x, a, dim, method):
    oracle = discounted_cumsum_oracle(x, a, dim, extended=EXTENDED)
    ref = discounted_cumsum(x, a, dim=dim, method="reference")
    out = discounted_cumsum(x, a, dim=dim, method=method)
    check_output(f"shape {tuple(x.shape)} dim={dim}", out, x, a, oracle, ref, method, dim)
    return out


DIM_CASES = {
    # name: (x shape, dim, discount shape or None for a scalar)
    "2d-dim0": ((300, 3), 0, None),
    "2d-dim0-per-column": ((300, 3), 0, (1, 3)),
    "2d-dim0-per-token": ((300, 3), 0, (300, 3)),
    "2d-dim1": ((3, 300), 1, (3, 300)),
    "2d-per-time": ((3, 300), -1, (300,)),
    "2d-dim-2": ((300, 3), -2, (300, 1)),
    "3d-last": ((2, 4, 300), -1, (2, 4, 300)),
    "3d-last-per-row": ((2, 4, 300), 2, (2, 1, 1)),
    "3d-middle": ((2, 300, 4), 1, (2, 300, 4)),
    "3d-middle-per-time": ((2, 300, 4), 1, (300, 1)),
    "3d-first": ((300, 2, 4), 0, (300, 2, 4)),
    "1d": ((300,), 0, (300,)),
    "1d-scalar-tensor": ((300,), -1, ()),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(DIM_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dims_and_broadcasting(name, method, dtype):
    shape, dim, a_shape = DIM_CASES[name]
    gen = torch.Generator().manual_seed(_seed(name))
    x = torch.randn(shape, generator=gen, dtype=dtype)
    if a_shape is None:
        a = 0.97
    else:
        a = (0.9 + 0.1 * torch.rand(a_shape, generator=gen, dtype=torch.float64)).to(dtype)
    _run_dim_case(x, a, dim, method)


@pytest.mark.parametrize("method", METHODS)
def test_dim_agrees_with_transposed_input(method):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(500, 3, generator=gen, dtype=torch.float64)
    a = 0.5 + 0.5 * torch.rand(500, 3, generator=gen, dtype=torch.float64)
    y0 = discounted_cumsum(x, a, dim=0, method=method)
    y1 = discounted_cumsum(x.t().contiguous(), a.t().contiguous(), dim=-1, method=method)
    oracle = discounted_cumsum_oracle(x, a, dim=0, extended=EXTENDED)
    abs_oracle = discounted_cumsum_oracle(x.abs(), a, dim=0, extended=EXTENDED)
    bound = serial_bound(500, torch.float64, abs_oracle)
    assert_within_bound("dim=0", y0, oracle, bound)
    assert_within_bound("transposed, dim=-1", y1.t(), oracle, bound)


@pytest.mark.parametrize("method", METHODS)
def test_float64_discount_with_float32_input(method):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 1000, generator=gen)
    a = 0.9 + 0.1 * torch.rand(3, 1000, generator=gen, dtype=torch.float64)
    _run_dim_case(x, a, -1, method)


def _non_contiguous_views(gen, dtype):
    """(name, x, discount) with x a non-contiguous [3, 257] view."""
    big = torch.randn(3, 514, generator=gen, dtype=dtype)
    col_major = torch.randn(257, 3, generator=gen, dtype=dtype)
    a_big = (0.8 + 0.2 * torch.rand(514, 3, generator=gen, dtype=torch.float64)).to(dtype)
    row = torch.randn(1, 257, generator=gen, dtype=dtype)
    interleaved = torch.randn(3, 257, 2, generator=gen, dtype=dtype)
    return [
        ("strided-time", big[:, ::2], 0.99),
        ("transposed", col_major.t(), a_big[::2].t()),
        ("interleaved", interleaved[..., 1], a_big[:257].t()),
        ("expanded", row.expand(3, 257), a_big[1::2].t()),
        ("offset-slice", big[1:, 100:357], 0.9405),
    ]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_non_contiguous_inputs(method, dtype):
    for name, x, a in _non_contiguous_views(torch.Generator().manual_seed(5), dtype):
        x_before = x.clone()
        a_before = a.clone() if isinstance(a, torch.Tensor) else a
        oracle = discounted_cumsum_oracle(x, a, extended=EXTENDED)
        a_full = a.to(_full(dtype)) if isinstance(a, torch.Tensor) else a
        ref = discounted_cumsum(x.to(_full(dtype)), a_full, method="reference")
        out = discounted_cumsum(x, a, method=method)
        check_output(name, out, x, a, oracle, ref, method)
        assert torch.equal(x, x_before), f"{name}: the input was modified"
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, a_before), f"{name}: the discount was modified"


@pytest.mark.parametrize("method", METHODS)
def test_input_is_not_modified(method):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 1000, generator=gen)
    a = torch.rand(3, 1000, generator=gen)
    x0, a0 = x.clone(), a.clone()
    out = discounted_cumsum(x, a, method=method)
    assert torch.equal(x, x0) and torch.equal(a, a0)
    assert out.data_ptr() != x.data_ptr()


EMPTY_SHAPES = [((3, 0), -1), ((0, 5), -1), ((0, 0), -1), ((2, 0, 4), 1), ((0,), 0), ((4, 0), 0)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("shape", "dim"), EMPTY_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_empty_inputs(method, shape, dim, dtype):
    x = torch.empty(shape, dtype=dtype)
    for a in (0.9, torch.full(shape, 0.5, dtype=dtype)):
        y = discounted_cumsum(x, a, dim=dim, method=method)
        assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.slow
@pytest.mark.parametrize("method", FAST_METHODS)
def test_long_sequence_at_discount_one(method):
    """T = 131072 at discount 1 with a reward of 1e4 on the last token: the serial float32 loop
    adds O(1) terms to a running 1e4 and loses ~1e-3 per step; no method may do worse than
    twice that. The oracle is the float64 reversed cumulative sum."""
    x, oracle, ref = _long_case()
    out = discounted_cumsum(x, 1.0, method=method)
    assert out.dtype == torch.float32
    chunked = discounted_cumsum(x, 1.0, method="chunked")
    assert_within_reference(f"T=131072 {method}", out, oracle, ref, chunked_out=chunked)


@needs_numba
def test_compiled_splits_rows_over_threads():
    """Enough rows and tokens for the compiled kernel to split groups of rows over threads:
    every row equals the kernel run on that row alone, bit for bit, and the serial kernel
    stays within the serial loop's a priori bound of the oracle."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, 1 << 16, generator=gen)
    for a in (0.99, make_discount("token", 0.99, tuple(x.shape), torch.float32, gen)):
        y = discounted_cumsum(x, a, method="compiled")
        for b in (0, 3, 4, 8):
            a_b = a[b : b + 1] if isinstance(a, torch.Tensor) else a
            assert torch.equal(
                y[b : b + 1], discounted_cumsum(x[b : b + 1], a_b, method="compiled")
            )
        oracle = discounted_cumsum_oracle(x, a, extended=EXTENDED)
        bound = serial_bound(x.shape[-1], torch.float32, discounted_cumsum_oracle(x.abs(), a))
        assert_within_bound("compiled, threaded", y, oracle, bound)


@functools.cache
def _long_case():
    T = 131072
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, T, generator=gen)
    x[:, -1] = 1e4
    oracle = reversed_cumsum_oracle(x, extended=EXTENDED)
    ref = discounted_cumsum(x, 1.0, method="reference")
    return x, oracle, ref


@needs_numba
@pytest.mark.parametrize("t_len", [1, 127, 129, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_per_token_pass_without_the_select(t_len, dtype):
    """The per-token kernel first scans without selecting the carry away at a zero decay (while
    every carry is finite, ``fma(0, c, x)`` is ``x``): on finite inputs its outputs are those of
    the pass with the select, bit for bit, and the sum of its carries it returns is finite; a
    NaN or inf on the way makes that sum non-finite, which sends the rows to the select pass."""
    from rlops.scan import _numba_kernels as k

    gen = torch.Generator().manual_seed(t_len)
    x = torch.randn(5, t_len, generator=gen, dtype=dtype)
    a = torch.rand(5, t_len, generator=gen, dtype=dtype)
    a[:, ::3] = 0.0
    fast, cut = torch.empty_like(x), torch.empty_like(x)
    for rows in ((0, 1, 2, 3), (4, 4, 4, 4)):
        total = k._tokens_fast(x.numpy(), a.numpy(), fast.numpy(), rows)
        k._tokens_cut(x.numpy(), a.numpy(), cut.numpy(), rows)
        assert torch.isfinite(torch.tensor(total))
    assert torch.equal(fast, cut)
    for poison in (float("nan"), float("inf")):
        bad = x.clone()
        bad[2, -1] = poison
        total = k._tokens_fast(bad.numpy(), a.numpy(), fast.numpy(), (0, 1, 2, 3))
        assert not torch.isfinite(torch.tensor(total))
        got = discounted_cumsum(bad, a, method="compiled")
        k._tokens_cut(bad.numpy(), a.numpy(), cut.numpy(), (0, 1, 2, 3))
        k._tokens_cut(bad.numpy(), a.numpy(), cut.numpy(), (4, 4, 4, 4))
        assert bool(((got == cut) | (got.isnan() & cut.isnan())).all())
        if t_len > 1:  # the last zero decay before the poison: nothing crosses it
            cut_at = (t_len - 2) // 3 * 3
            assert torch.isfinite(got[:, : cut_at + 1]).all()
