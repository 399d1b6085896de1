"""The log-prob kernels with the vocabulary split across programs (under the interpreter).

The statistics kernel reduces fixed vocabulary slices (:func:`rlops.logprobs.triton._slice_tiles`
tiles each, a function of the vocabulary alone), one program each, from fresh accumulators and
folds them in slice order; the gradient kernel's programs share a row's tiles
(:func:`rlops.logprobs.triton._splits`, from N). Checked here: the split results (and gradients)
against the float64 reference by the suite's rule with the unsplit kernel (one slice) and the
float32 reference as yardsticks, for every option; bitwise equality whatever the programs and
N (batch invariance); slices that hold nothing of a distribution (a keep mask's gap, ``-inf``
logits); a NaN logit in a later slice.
"""

from __future__ import annotations

import pytest
import torch
from tests._logprobs_util import assert_as_accurate, forward_backward, nan_filled_empty
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

from rlops.logprobs import _options, logprobs_and_entropy
from rlops.logprobs import triton as kernels
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference
from rlops.logprobs.reference import sampler_keep_mask

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

V = 1000  # the interpreter's 256-wide tiles: 4 slices of one tile, or 1 slice of all
FACTORS = (2.0, 2.0, 3.0, 2.0)  # logp, entropy, grad, Σπ² (tests.tolerances)
CASES = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "keep_mask": {"keep_mask": True},
    "no entropy": {"with_entropy": False},
    "Σπ²": {"with_sum_pi_squared": True, "keep_mask": True, "temperature": 1.3},
    "top_k+top_p": {"top_k": 50, "top_p": 0.9, "temperature": 0.7},
    "min_p": {"min_p": 0.05},
    "top_p over support": {"top_p": 0.8, "entropy_over_support": True},
}


@pytest.fixture(autouse=True)
def _kernels_ran():
    yield
    assert _options.failed() is None, f"the kernels were set aside: {_options.failed()}"


def _data(n, v=V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 3).float()
    target = torch.randint(0, v, (n,), generator=gen)
    keep = torch.rand(n, v, generator=gen) < 0.5
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return logits, target, keep, grads


def _kw(case, keep):
    kw = dict(CASES[case])
    if kw.get("keep_mask") is True:
        kw["keep_mask"] = keep
    return kw


def _triton(monkeypatch, tiles, programs, logits, target, grads, kw):
    """``[logp, entropy, (Σπ²), grad]`` of the op with ``tiles`` tiles per slice and a device
    of ``programs`` programs (the gradient's split: ``programs // row blocks`` programs per
    block of rows)."""
    monkeypatch.setattr(kernels, "_slice_tiles", lambda x: tiles)
    monkeypatch.setattr(kernels, "_programs", lambda x: programs)
    extra = [None] if kw.get("with_sum_pi_squared") else []
    with nan_filled_empty():
        return forward_backward(
            lambda x, y: logprobs_and_entropy(x, y, method="triton", **kw),
            (logits, target), grads + extra,
        )  # fmt: skip


def _reference(logits, target, grads, kw):
    ref_kw = {k: kw[k] for k in ("temperature", "keep_mask", "with_entropy") if k in kw}
    sampler = {k: kw[k] for k in ("top_k", "top_p", "min_p") if k in kw}
    if sampler:  # the sampler's support on the float32 scaled logits, as a mask
        ref_kw["keep_mask"] = sampler_keep_mask(logits / kw.get("temperature", 1.0), **sampler)
    if kw.get("entropy_over_support"):
        ref_kw["entropy_over_support"] = True
    if kw.get("with_sum_pi_squared"):
        ref_kw["with_sum_pi_squared"] = True
    extra = [None] if kw.get("with_sum_pi_squared") else []

    def run(x):
        return forward_backward(reference, (x, target), grads + extra, **ref_kw)

    return run(logits), run(logits.double())


def _names(kw):
    return ("logp", "entropy", "Σπ²", "grad") if kw.get("with_sum_pi_squared") else (
        "logp", "entropy", "grad")  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_split_matches_the_unsplit_kernel_and_the_reference(monkeypatch, case):
    logits, target, keep, grads = _data(37, seed=len(case))
    kw = _kw(case, keep)
    split = _triton(monkeypatch, 1, 10_000, logits, target, grads, kw)  # 4 slices
    whole = _triton(monkeypatch, 100, 10_000, logits, target, grads, kw)  # 1 slice
    ref, exact = _reference(logits, target, grads, kw)
    names = _names(kw)
    for k, name in enumerate(names):
        if split[k] is None:
            assert whole[k] is None and not kw.get("with_entropy", True)
            continue
        factor = FACTORS[("logp", "entropy", "grad", "Σπ²").index(name)]
        assert_as_accurate(split[k], whole[k], exact[k], factor, f"split vs unsplit {name}")
        assert_as_accurate(split[k], ref[k], exact[k], factor, f"split {name}")


@pytest.mark.parametrize("case", ["plain", "Σπ²", "top_k+top_p"])
def test_a_rows_bits_do_not_depend_on_n_or_the_split(monkeypatch, case):
    """Batch invariance, bitwise: a row alone, among 37 rows, or at another position, with
    the gradient's tiles in one program per row or one per tile, gives the same bits."""
    logits, target, keep, grads = _data(37, seed=3)
    kw = _kw(case, keep)
    outs = [_triton(monkeypatch, 1, p, logits, target, grads, kw) for p in (1, 10_000)]
    for a, b in zip(*outs, strict=True):
        assert a is None or torch.equal(a, b)
    full = outs[0]
    for rows in ([5], [30, 5, 2], list(range(36, -1, -1))):
        idx = torch.tensor(rows)
        sub_kw = dict(kw)
        if "keep_mask" in sub_kw:
            sub_kw["keep_mask"] = kw["keep_mask"][idx]
        sub = _triton(monkeypatch, 1, 10_000, logits[idx], target[idx],
                      [g[idx] for g in grads], sub_kw)  # fmt: skip
        for a, b in zip(full, sub, strict=True):
            assert a is None or torch.equal(a[idx], b), rows


def test_slices_with_nothing_of_a_distribution(monkeypatch):
    """A keep mask that drops a whole slice of every row (the log-prob's partial there has
    max -inf, sums 0), and a row whose logits are -inf over a whole slice."""
    logits, target, keep, grads = _data(9, seed=4)
    keep[:, 256:512] = False
    target[target // 256 == 1] = 100  # the target is kept anyway: keep the gap whole
    logits[0, 512:768] = float("-inf")
    target[0] = 3
    kw = {"keep_mask": keep, "with_sum_pi_squared": True}
    split = _triton(monkeypatch, 1, 10_000, logits, target, grads, kw)
    whole = _triton(monkeypatch, 100, 10_000, logits, target, grads, kw)
    # the reference's entropy is NaN at a -inf logit (0 · -inf): -1e30 is the same
    # distribution (probability exactly 0) with 0 · -1e30 = 0
    ref, exact = _reference(logits.clamp(min=-1e30), target, grads, kw)
    for k, name in enumerate(_names(kw)):
        factor = FACTORS[("logp", "entropy", "grad", "Σπ²").index(name)]
        assert split[k].isfinite().all(), name
        assert_as_accurate(split[k], whole[k], exact[k], factor, f"split vs unsplit {name}")
        assert_as_accurate(split[k], ref[k], exact[k], factor, f"split {name}")


def test_a_nan_logit_in_a_later_slice_reaches_its_row(monkeypatch):
    """A NaN logit in slice 3 of row 1: that row's log-prob, entropy and gradient are NaN (as
    torch's), the other rows' bits those of the call without it."""
    logits, target, _, grads = _data(6, seed=5)
    target[1] = 10
    clean = _triton(monkeypatch, 1, 10_000, logits, target, grads, {})
    logits[1, 800] = float("nan")
    split = _triton(monkeypatch, 1, 10_000, logits, target, grads, {})
    others = torch.tensor([0, 2, 3, 4, 5])
    for a, b in zip(split, clean, strict=True):
        assert a[1].isnan().all()
        assert torch.equal(a[others], b[others])


def test_the_split_and_the_grid():
    """The gradient's grid: programs along the vocabulary fill the device's programs when the
    rows are few, one per block of rows once they are many; every tile covered exactly once."""
    x = torch.empty(0)
    assert kernels._splits(x, 1, 10) == (10, 1)  # one row, 10 tiles: a program each
    assert kernels._splits(x, 220, 10) == (3, 4)  # 528 programs wanted: 220 × 3 (4, 4, 2)
    assert kernels._splits(x, 600, 10) == (1, 10)  # enough rows: one program per row
    assert kernels._splits(x, 4, 38) == (38, 1)
    for blocks in range(1, 700, 7):
        for units in (1, 2, 10, 13, 38):
            splits, per = kernels._splits(x, blocks, units)
            assert (splits - 1) * per < units <= splits * per


@pytest.mark.parametrize(
    "kw", [{}, {"temperature": 0.7, "keep_mask": True}, {"top_p": 0.9, "with_entropy": False}]
)
def test_the_peeled_last_tile_changes_no_bit(kw):
    """Rows that start aligned at an odd vocabulary (a view of rows padded to 1008, V = 1001):
    the kernels load the tiles inside V without a bound along the vocabulary and peel the
    last, partial one; the same tiles in the same order as the contiguous copy's (no peel),
    so the same bits, outputs and gradient."""
    n, v, width = 21, 1001, 1008
    gen = torch.Generator().manual_seed(9)
    full = torch.randn(n, width, generator=gen) * 3
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    kw = dict(kw)
    keep_full = torch.rand(n, width, generator=gen) < 0.5
    res = []
    for padded in (True, False):
        x = full[:, :v] if padded else full[:, :v].contiguous()
        one = dict(kw)
        if kw.get("keep_mask") is True:
            one["keep_mask"] = keep_full[:, :v] if padded else keep_full[:, :v].contiguous()
        keep = one.get("keep_mask")
        assert kernels._peel(v, x, keep) == padded
        with nan_filled_empty():
            res.append(forward_backward(
                lambda x, y, one=one: logprobs_and_entropy(x, y, method="triton", **one),
                (x, target), grads,
            ))  # fmt: skip
    for a, b in zip(*res, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
