"""``logprobs_and_entropy(..., method="triton")``: the chunk engine with the Triton producer,
under the CPU interpreter, against the reference and the chunked method.

Forward and backward against the unfused reference (:mod:`rlops.logprobs.reference`): float32
results within twice the float32 reference's error against float64 (gradients three times);
float64 results within twice the float64 reference's error against a ``longdouble`` oracle;
half-precision gradients against the float32 reference's rounded to their dtype, one ulp
apart at most beyond the float32 budget (:func:`tests.tolerances.assert_half_matches`), and
likewise against the chunked method's. The interpreter's blocks are 256 wide, so vocabularies
above 256 cross tiles (the online log-sum-exp). Also: the sampler's support, the flags, the
shard statistics at an offset, the method's errors, a kernel that fails to build (injected)
and, on a 2-rank Gloo group, the vocabulary-parallel op.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from tests._distributed import run_distributed
from tests._logprobs_util import (
    assert_as_accurate,
    assert_as_accurate_as_float64,
    forward_backward,
    longdouble_oracle,
    nan_filled_empty,
    sum_pi_squared_oracle,
)
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)
from tests.tolerances import assert_half_matches

from rlops import _backends
from rlops.logprobs import _options, _softmax, logprobs_and_entropy
from rlops.logprobs import triton as kernels
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import sampler_keep_mask

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0
FACTORS = (FACTOR_FWD, FACTOR_FWD, FACTOR_GRAD)
WHAT = ("logp", "entropy", "grad")

# numpy on the interpreter's masked lanes (exp(-inf), log 0) warns; the kernels' own
# fallback warning is checked with pytest.warns, which records whatever the filters say
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _kernels_ran():
    """Every test but the injected failures ends with the kernels in use: a silent fallback
    to the torch maths would make the comparisons below vacuous."""
    yield
    assert _options.failed() is None, f"the kernels were set aside: {_options.failed()}"


def _data(shape, v, *, scale=3.0, seed=0, keep_frac=None, dtype=torch.float32):
    shape = (shape,) if isinstance(shape, int) else shape
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, v, shape, generator=gen)
    keep = None
    if keep_frac is not None:
        keep = torch.rand(*shape, v, generator=gen) < keep_frac
        keep.scatter_(-1, target.unsqueeze(-1), False)  # the op must keep the target anyway
    grads = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)]
    return logits, target, keep, grads


def _op(method, **kw):
    return lambda x, y: logprobs_and_entropy(x, y, method=method, **kw)


def _check(logits, target, grads, **kw):
    """``method="triton"`` vs the reference (float64, or longdouble for float64 logits) with
    the same-dtype reference's error as the yardstick, and vs ``method="chunked"`` by the same
    rule. ``kw``: the op's keywords; a sampler's support is the reference's
    (:func:`sampler_keep_mask` on the float32 scaled logits), given to the reference as a mask."""
    with nan_filled_empty():
        fast = forward_backward(_op("triton", **kw), (logits, target), grads)
    chunked = forward_backward(_op("chunked", **kw), (logits, target), grads)
    ref_kw = _reference_keywords(logits, kw)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert fast[0].dtype == acc and fast[2].dtype == logits.dtype
    if kw.get("with_entropy", True):
        assert fast[1].dtype == acc
    ref = forward_backward(reference, (logits.to(acc), target), grads, **ref_kw)
    if logits.dtype == torch.float64:
        z = logits.reshape(-1, logits.shape[-1])
        keep = ref_kw.get("keep_mask")
        support = torch.ones_like(z, dtype=torch.bool) if keep is None else keep.reshape(z.shape)
        oracle = longdouble_oracle(
            z, target.reshape(-1), support, [g.reshape(-1) for g in grads],
            temperature=kw.get("temperature", 1.0),
            over_support=kw.get("entropy_over_support", False),
        )  # fmt: skip
        for k in range(3):
            if fast[k] is None:
                continue
            for name, out in (("triton", fast[k]), ("chunked", chunked[k])):
                got = out.reshape(oracle[k].shape)
                assert_as_accurate_as_float64(got, ref[k].reshape(got.shape), oracle[k],
                                              FACTORS[k], f"{name} {WHAT[k]}")  # fmt: skip
        return fast
    exact = forward_backward(reference, (logits.double(), target), grads, **ref_kw)
    for k in range(3):
        if fast[k] is None:
            continue
        if k == 2 and logits.dtype != torch.float32:  # half gradients, rounded from float32
            assert_half_matches("triton grad", fast[2], ref[2], exact[2])
            assert_half_matches("triton grad vs chunked", fast[2], chunked[2].float(), exact[2])
            continue
        assert_as_accurate(fast[k], ref[k], exact[k], FACTORS[k], f"triton {WHAT[k]}")
        assert_as_accurate(fast[k], chunked[k], exact[k], FACTORS[k], f"vs chunked {WHAT[k]}")
    return fast


def _reference_keywords(logits, kw):
    out = {k: kw[k] for k in ("temperature", "keep_mask", "with_entropy") if k in kw}
    sampler = {k: kw[k] for k in ("top_k", "top_p", "min_p") if k in kw}
    if sampler:
        z = logits.float() / kw.get("temperature", 1.0)
        out["keep_mask"] = sampler_keep_mask(z, **sampler)
    if kw.get("entropy_over_support"):
        out["entropy_over_support"] = True
    return out


# --------------------------------------------------------------------------- values, gradients
@pytest.mark.parametrize("v", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(v, masked):
    logits, target, keep, grads = _data(37, v, seed=v, keep_frac=0.4 if masked else None)
    _check(logits, target, grads, keep_mask=keep)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature_leading_dims_and_chunks(temperature):
    """Tokens ``[3, 101]`` (303), several launches of 64 rows (the last one short)."""
    logits, target, keep, grads = _data((3, 101), 300, seed=3, keep_frac=0.5)
    _check(logits, target, grads, temperature=temperature)
    _check(logits, target, grads, temperature=temperature, keep_mask=keep, chunk_size=64)


def test_large_vocab_and_offset_logits():
    """V = 4096 over 16 tiles, logits around 1e3: the entropy's terms do not cancel."""
    logits, target, _, grads = _data(8, 4096, scale=10.0, seed=4)
    _check(logits + 1e3, target, grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes(dtype):
    logits, target, keep, grads = _data(19, 333, seed=5, keep_frac=0.5, dtype=dtype)
    _check(logits, target, grads)
    _check(logits, target, grads, keep_mask=keep, temperature=0.8)


SAMPLERS = {
    "top_k": {"top_k": 20},
    "top_p": {"top_p": 0.8},
    "top_k and top_p": {"top_k": 10, "top_p": 0.6},
    "min_p": {"min_p": 0.05},
    "all three": {"top_k": 20, "top_p": 0.9, "min_p": 0.01},
}


@pytest.mark.parametrize("case", list(SAMPLERS))
@pytest.mark.parametrize("over_support", [False, True])
def test_sampler_support(case, over_support):
    """The support ``z ≥ t`` from the torch threshold, read by the kernels; the log-prob over
    it, the entropy over all logits or (``entropy_over_support``) over it too."""
    logits, target, _, grads = _data(41, 500, seed=6)
    _check(logits, target, grads, **SAMPLERS[case], temperature=1.3,
           entropy_over_support=over_support, chunk_size=16)  # fmt: skip


def test_sampler_per_token_parameters_bfloat16():
    logits, target, _, grads = _data(23, 257, seed=7, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    top_k = torch.randint(1, 300, (23,), generator=gen)  # some >= V: keep all
    top_p = torch.rand(23, generator=gen) * 0.9 + 0.05
    _check(logits, target, grads, top_k=top_k, top_p=top_p, temperature=0.9)


def test_entropy_flags():
    logits, target, keep, grads = _data(10, 200, seed=9, keep_frac=0.5)
    _check(logits, target, grads, with_entropy=False)
    _check(logits, target, grads, keep_mask=keep, with_entropy=False)
    for kw in ({}, {"keep_mask": keep}, {"top_k": 5}):
        x = logits.clone().requires_grad_()
        lp, ent = logprobs_and_entropy(x, target, method="triton", entropy_grad=False, **kw)
        assert not ent.requires_grad
        lp.backward(grads[0])
        x2 = logits.clone().requires_grad_()
        logprobs_and_entropy(x2, target, method="chunked", **kw)[0].backward(grads[0])
        torch.testing.assert_close(x.grad, x2.grad)


def test_strided_logits():
    """A column slice (rows with a stride above V) is read in place; transposed logits (no unit
    stride along the vocabulary) are copied first."""
    logits, target, _, grads = _data(30, 131, seed=10)
    wide = torch.cat([logits, torch.randn(30, 5)], dim=1)
    _check(wide[:, :131], target, grads, temperature=0.7)
    _check(logits.t().contiguous().t(), target, grads)


def test_minus_inf_logits():
    """A -inf logit has probability 0: the results are those of the finite logits alone, and
    its gradient is 0 (the reference's entropy is NaN there: 0 * -inf)."""
    logits, target, _, grads = _data(6, 100, seed=11)
    target = target % 50
    finite = logits[:, :50].clone()
    logits[:, 50:] = float("-inf")
    fast = forward_backward(_op("triton"), (logits, target), grads)
    ref = forward_backward(reference, (finite, target), grads)
    torch.testing.assert_close(fast[0], ref[0])
    torch.testing.assert_close(fast[1], ref[1])
    torch.testing.assert_close(fast[2][:, :50], ref[2])
    assert (fast[2][:, 50:] == 0).all()


def test_double_backward_is_the_engines():
    """``create_graph=True`` goes through the engine's differentiable backward, whatever the
    producer: the same Hessian-vector product as the chunked method."""
    logits, target, _, _ = _data(5, 40, seed=12, dtype=torch.float64)
    vec = torch.randn(5, 40, dtype=torch.float64)
    hvps = []
    for method in ("triton", "chunked"):
        x = logits.clone().requires_grad_()
        lp, ent = logprobs_and_entropy(x, target, method=method, temperature=0.9)
        (g,) = torch.autograd.grad(lp.sum() + ent.sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((g * vec).sum(), x)[0])
    torch.testing.assert_close(hvps[0], hvps[1], rtol=1e-10, atol=1e-12)


def test_empty_batch():
    logits = torch.randn(0, 17, requires_grad=True)
    lp, ent = logprobs_and_entropy(logits, torch.zeros(0, dtype=torch.long), method="triton")
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 17)


@pytest.mark.parametrize("masked", [False, True])
def test_shards_merge_to_the_whole_vocabulary(masked):
    """Statistics of two vocabulary shards (unequal sizes, the second at an offset), merged as
    under tensor parallelism, give the reference; each shard's gradient is the matching slice
    of the reference's."""
    logits, target, keep, grads = _data(21, 300, seed=13, keep_frac=0.5 if masked else None)
    cuts = [(0, 128), (128, 300)]
    stats = torch.stack([
        kernels.shard_stats(logits[:, a:b], target, offset=a, temperature=1.3, block_n=8,
                            block_v=64, keep_mask=None if keep is None else keep[:, a:b])
        for a, b in cuts
    ])  # fmt: skip
    logp, ent, saved = _softmax.merge(stats, masked, True)
    ref_lp, ref_ent = reference(logits.double(), target, temperature=1.3, keep_mask=keep)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    x = logits.double().requires_grad_()
    lp, en = reference(x, target, temperature=1.3, keep_mask=keep)
    torch.autograd.backward([lp, en], [grads[0].double(), grads[1].double()])
    for a, b in cuts:
        g = kernels.logits_grad(logits[:, a:b], target, saved, grads[0], grads[1], offset=a,
                                temperature=1.3, keep_mask=None if keep is None else keep[:, a:b],
                                block_n=8, block_v=64)  # fmt: skip
        torch.testing.assert_close(g.double(), x.grad[:, a:b], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- Σπ²
SQUARE_CASES = {
    "plain": {},
    "masked, temperature": {"keep": 0.4, "temperature": 0.7},
    "top_k, no entropy": {"top_k": 20, "with_entropy": False, "chunk_size": 16},
    "top_p over the support": {"top_p": 0.8, "entropy_over_support": True},
}


F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
SQUARE_PARAMS = [
    *((case, v, dtype) for case in SQUARE_CASES for v in (1, 127, 129) for dtype in (F32, F64)),
    *((case, 1000, dtype) for case in ("plain", "top_p over the support") for dtype in (F32, F64)),
    ("masked, temperature", 333, BF16),
    ("top_k, no entropy", 129, BF16),
]


@pytest.mark.parametrize(
    ("case", "v", "dtype"),
    SQUARE_PARAMS,
    ids=[f"{c}-{v}-{str(d)[6:]}" for c, v, d in SQUARE_PARAMS],
)
def test_sum_pi_squared(case, v, dtype):
    """``Σπ²`` of the log-prob's distribution from the kernel's float64 sums, against the
    definition (float64 reference, longdouble for float64 logits) by the same-dtype
    reference's error, and against the chunked method's by the same rule."""
    kw = dict(SQUARE_CASES[case])
    keep_frac = kw.pop("keep", None)
    # 257 rows: the yardstick is the reference's max error, one row's luck over fewer (in
    # float64 the kernel's w / σ² and the reference's Σ (e / s)² have the same error
    # distribution, measured over 40000 rows)
    logits, target, keep, _ = _data(257, v, seed=v + len(case), keep_frac=keep_frac,
                                    dtype=dtype)  # fmt: skip
    if keep is not None:
        kw["keep_mask"] = keep
    with nan_filled_empty():
        sq = logprobs_and_entropy(logits, target, method="triton", with_sum_pi_squared=True,
                                  **kw)[2]  # fmt: skip
    chunked = logprobs_and_entropy(logits, target, method="chunked", with_sum_pi_squared=True,
                                   **kw)[2]  # fmt: skip
    tau, sampler = kw.get("temperature", 1.0), {k: kw[k] for k in ("top_k", "top_p") if k in kw}
    support = kw.get("keep_mask")
    if sampler:  # the sampler's support, on the scaled logits in the compute dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        support = sampler_keep_mask(logits.to(acc) / tau, **sampler)

    def ref(x):
        return reference(x, target, temperature=tau, keep_mask=support, with_entropy=False,
                         with_sum_pi_squared=True)[2]  # fmt: skip

    if dtype == torch.float64:
        oracle = sum_pi_squared_oracle(logits, target, support, tau)
        assert_as_accurate_as_float64(sq, ref(logits), oracle, FACTOR_FWD, "triton Σπ²")
        assert_as_accurate_as_float64(sq, chunked, oracle, FACTOR_FWD, "triton vs chunked Σπ²")
        return
    exact = ref(logits.double())
    assert_as_accurate(sq, ref(logits), exact, FACTOR_FWD, "triton Σπ²")
    assert_as_accurate(sq, chunked, exact, FACTOR_FWD, "triton vs chunked Σπ²")


def test_sum_pi_squared_changes_nothing_else():
    """Asking for ``Σπ²`` leaves the log-prob, the entropy and the gradient bit for bit, and
    ``Σπ²`` has no gradient."""
    logits, target, keep, grads = _data(33, 300, seed=15, keep_frac=0.5)
    for kw in ({"keep_mask": keep, "temperature": 1.2}, {"top_k": 9}):
        fast = forward_backward(_op("triton", with_sum_pi_squared=True, **kw), (logits, target),
                                [*grads, None])  # fmt: skip
        plain = forward_backward(_op("triton", **kw), (logits, target), grads)
        for a, b in zip([fast[0], fast[1], fast[3]], plain, strict=True):
            assert torch.equal(a, b)
        x = logits.clone().requires_grad_()
        assert not logprobs_and_entropy(x, target, method="triton", with_sum_pi_squared=True,
                                        **kw)[2].requires_grad  # fmt: skip


def test_sum_pi_squared_of_shards_merges():
    """Two shards' statistics with the Σπ² column (unequal sizes, one at an offset, a keep mask
    that leaves a shard empty on some rows), merged as under tensor parallelism."""
    logits, target, keep, _ = _data(21, 300, seed=14, keep_frac=0.3, dtype=torch.float64)
    keep[:7, 128:] = False  # rows whose second shard holds nothing but maybe the target
    cuts = [(0, 128), (128, 300)]
    stats = torch.stack([
        kernels.shard_stats(logits[:, a:b], target, offset=a, temperature=1.3, block_n=8,
                            block_v=64, keep_mask=keep[:, a:b], with_squares=True)
        for a, b in cuts
    ])  # fmt: skip
    assert stats.shape == (2, 21, 7)
    _, _, saved = _softmax.merge(stats, True, True)
    sq = _softmax.merge_squares(stats, True, True, saved)
    oracle = sum_pi_squared_oracle(logits, target, keep, 1.3)
    ref = reference(logits, target, temperature=1.3, keep_mask=keep, with_entropy=False,
                    with_sum_pi_squared=True)[2]  # fmt: skip
    assert_as_accurate_as_float64(sq, ref, oracle, FACTOR_FWD, "merged Σπ²")


# --------------------------------------------------------------------------- the method
def test_method_errors(monkeypatch):
    logits, target, _, _ = _data(4, 10)
    with pytest.raises(ValueError, match="method must be one of"):
        logprobs_and_entropy(logits, target, method="kernels")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        logprobs_and_entropy(logits, target, method="triton")
    monkeypatch.setitem(sys.modules, "triton", None)  # triton cannot be imported
    with pytest.raises(ValueError, match=r"rlops\[gpu\]"):
        logprobs_and_entropy(logits, target, method="triton")
    # auto never needs triton on CPU, nor "chunked" anywhere
    logprobs_and_entropy(logits, target)
    logprobs_and_entropy(logits, target, method="chunked")


def test_auto_picks_triton_on_cuda_only(monkeypatch):
    """``auto`` (the choice reads only the device): Triton for CUDA tensors, chunked on CPU
    (even under the interpreter), while ``torch.compile`` traces, and without triton."""
    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    cpu = torch.zeros(1)
    assert _options.resolve("auto", cuda) == "triton"
    assert _options.resolve("auto", cpu) == "chunked"
    assert _options.resolve("triton", cpu) == "triton"  # under the interpreter
    with pytest.raises(ValueError, match="CUDA"):
        _options.resolve("triton", types.SimpleNamespace(device=torch.device("meta")))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _options.resolve("auto", cuda) == "chunked"
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "triton", None)
    assert _options.resolve("auto", cuda) == "chunked"


def _torch_definition(x, y, keep_mask=None):
    """``log_softmax(z)[y]`` (over the kept logits) and ``−Σ softmax(z)·log_softmax(z)`` (over
    all of them): torch's own operators, whatever they make of a NaN."""
    zk = x if keep_mask is None else x.masked_fill(~(keep_mask | _onehot(y, x)), float("-inf"))
    lp = torch.log_softmax(zk, -1).gather(-1, y[:, None])[:, 0]
    ls = torch.log_softmax(x, -1)
    return lp, -(ls.exp() * ls).sum(-1)


def _onehot(y, x):
    return torch.nn.functional.one_hot(y, x.shape[-1]).bool()


@pytest.mark.parametrize("where", ["other", "target", "outside the keep mask"])
def test_a_nan_logit_reaches_its_row_as_in_torch(where):
    """One NaN logit in row 1: the log-prob, entropy and gradients are torch's — NaN where
    torch's are NaN (the row, or only its entropy when the NaN lies outside the log-prob's keep
    mask), the same numbers elsewhere. The hardware max (``max.f32``, the interpreter's
    ``fmax``) skips NaN, so a clamp that skipped it too made the row finite."""
    v = 300
    logits, target, keep, grads = _data(6, v, seed=27, keep_frac=0.5)
    col = (target[1] + 7) % v if where != "target" else target[1]
    keep = keep if where == "outside the keep mask" else None
    if keep is not None:
        keep[1, col] = False
    logits[1, col] = float("nan")
    kw = {} if keep is None else {"keep_mask": keep}
    fast = forward_backward(_op("triton", **kw), (logits, target), grads)
    ref = forward_backward(_torch_definition, (logits, target), grads, **kw)
    exact = forward_backward(_torch_definition, (logits.double(), target), grads, **kw)
    assert exact[1][1].isnan() and not exact[1][[0, 2, 3, 4, 5]].isnan().any()
    for k, name in enumerate(WHAT):
        nan = exact[k].isnan()
        assert torch.equal(fast[k].isnan(), nan), f"{name}: NaN where torch's is not, or not"
        assert_as_accurate(fast[k][~nan], ref[k][~nan], exact[k][~nan], FACTORS[k], name)


class _Broken:
    """A kernel whose launch raises ``error`` (as a build failure does at the first launch)."""

    def __init__(self, error):
        self.error, self.launches = error, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            raise self.error

        return launch


def _build_error(kind="CompilationError"):
    """A build failure as a kernel's first launch raises it: triton's compilation error, or
    the plain RuntimeError a compiler pass raises."""
    if kind == "RuntimeError":
        return RuntimeError("PassManager::run failed: injected build failure")
    from triton.compiler.errors import CompilationError

    return CompilationError(None, None, "injected build failure")


def _rlops_warnings(record):
    return [w for w in record if str(w.message).startswith("rlops:")]


@pytest.mark.parametrize("error", ["CompilationError", "RuntimeError"])
@pytest.mark.parametrize("kernel", ["_stats_kernel", "_grad_kernel"])
def test_build_failure_warns_once_then_runs_chunked(monkeypatch, kernel, error):
    """A kernel that fails to build (injected at its launch): one RuntimeWarning naming the
    error, the call finishes on the torch maths (the chunked method's results), and every
    later call runs chunked without launching a kernel, ``method="triton"`` included."""
    monkeypatch.setattr(_backends, "_failed", {})
    broken = _Broken(_build_error(error))
    monkeypatch.setattr(kernels, kernel, broken)
    logits, target, keep, grads = _data(25, 150, seed=14, keep_frac=0.5)
    expected = forward_backward(_op("chunked", keep_mask=keep), (logits, target), grads)
    with pytest.warns(RuntimeWarning) as record:
        got = forward_backward(_op("triton", keep_mask=keep), (logits, target), grads)
    (warning,) = _rlops_warnings(record)
    assert error in str(warning.message)
    assert "injected build failure" in str(warning.message)
    assert "chunked" in str(warning.message)
    assert broken.launches == 1
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert _options.failed() is not None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = forward_backward(_op("triton", keep_mask=keep), (logits, target), grads)
    assert not _rlops_warnings(record) and broken.launches == 1
    for a, b in zip(again, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert _options.resolve("auto", types.SimpleNamespace(device=torch.device("cuda"))) == (
        "chunked"
    )


@pytest.mark.parametrize("kind", ["interpreter", "out of memory"])
def test_errors_that_are_not_build_failures_are_raised(monkeypatch, kind):
    """The interpreter's error (a kernel's own bug) and running out of memory (the call's, not
    the machine's) are raised, and the kernels stay in use."""
    from triton.runtime.errors import InterpreterError

    error = InterpreterError("kernel bug") if kind == "interpreter" else (
        torch.OutOfMemoryError("no memory left"))  # fmt: skip
    monkeypatch.setattr(kernels, "_stats_kernel", _Broken(error))
    logits, target, _, _ = _data(4, 10)
    with pytest.raises(type(error), match=str(error)):
        logprobs_and_entropy(logits, target, method="triton")


# --------------------------------------------------------------------------- tensor parallel
TP_SIZES = (20, 37)  # unequal shards of V = 57
TP_CASES = {
    "plain": {},
    "masked": {"mask": True, "temperature": 1.7, "chunk_size": 7},
    "top_k": {"top_k": 6, "temperature": 0.8},  # the candidates' merge
    "top_p over support": {"top_p": 0.7, "entropy_over_support": True},  # the radix select
    "entropy detached": {"entropy_grad": False},
    "sum_pi_squared masked": {"mask": True, "with_sum_pi_squared": True, "chunk_size": 7},
    "sum_pi_squared top_k": {"top_k": 6, "with_sum_pi_squared": True, "with_entropy": False},
    "per-row temperature": {"temperature": torch.linspace(0.3, 2.5, 19), "top_k": 6},
}


def _upstream(grads, kw):
    """The upstream gradients of the op's outputs: none into ``Σπ²``."""
    return [*grads, None] if kw.get("with_sum_pi_squared") else grads


def _tp_case(name):
    kw = dict(TP_CASES[name])
    logits, target, keep, grads = _data(
        19, sum(TP_SIZES), seed=sum(map(ord, name)), dtype=torch.float64,
        keep_frac=0.4 if kw.pop("mask", False) else None,
    )  # fmt: skip
    if keep is not None:
        kw["keep_mask"] = keep
    return logits, target, grads, kw


def _tensor_parallel(rank, world):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    cols = slice(sum(TP_SIZES[:rank]), sum(TP_SIZES[: rank + 1]))
    out = {}
    for name in TP_CASES:
        logits, target, grads, kw = _tp_case(name)
        if "keep_mask" in kw:
            kw["keep_mask"] = kw["keep_mask"][:, cols]
        res = forward_backward(
            lambda x, y, kw=kw: logprobs_and_entropy(x, y, group=group, method="triton", **kw),
            (logits[:, cols], target), _upstream(grads, kw),
        )  # fmt: skip
        out[name] = res
    out["failed"] = _options.failed()
    return out


@pytest.mark.distributed
def test_tensor_parallel_matches_one_process():
    """The vocabulary in two unequal shards on a Gloo group, each rank's statistics and
    gradient shard from the kernels, the collectives the engine's: every rank's outputs and
    gradient shard equal the one-process chunked results (float64)."""
    res = run_distributed(_tensor_parallel, 2)
    for r, rank_res in enumerate(res):
        assert rank_res["failed"] is None
        cols = slice(sum(TP_SIZES[:r]), sum(TP_SIZES[: r + 1]))
        for name in TP_CASES:
            logits, target, grads, kw = _tp_case(name)
            full = forward_backward(_op("chunked", **kw), (logits, target), _upstream(grads, kw))
            got = rank_res[name]
            for a, b in zip(got[:-1], full[:-1], strict=True):
                if b is None:
                    assert a is None, name
                    continue
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(got[-1], full[-1][:, cols], rtol=1e-12, atol=1e-12,
                                       msg=name)  # fmt: skip


def test_a_scale_or_softcap_runs_the_chunked_method():
    """The kernels apply the temperature only: with ``logit_scale`` or a softcap,
    ``method="triton"`` is the chunked method, bit for bit (values and gradient)."""
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(9, 300, generator=g) * 4, torch.randint(0, 300, (9,), generator=g)
    grads = [torch.randn(9, generator=g), torch.randn(9, generator=g)]
    for head in ({"logit_scale": 0.5}, {"final_logit_softcapping": 3.0}):
        kw = {"temperature": 0.8, "chunk_size": 4, **head}
        outs = [
            forward_backward(logprobs_and_entropy, (x, y), grads, method=m, **kw)
            for m in ("triton", "chunked")
        ]
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)), head
