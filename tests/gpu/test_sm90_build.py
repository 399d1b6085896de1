"""rlops's Triton kernels built for NVIDIA's sm_90, sm_80, sm_100 and sm_120 by the real
compiler, on CPU (AMD's targets: ``test_build_targets.py``).

Every kernel variant that the public functions launch at production shapes (the scan per row
and per token in float32 / bfloat16 / float64 and its backward; GAE, returns and REINFORCE++
with masks, dones and bootstraps; log-probs at V = 151936 and 50280 with temperature,
``top_k`` / ``top_p`` / ``min_p``, ``keep_mask``, entropy on and off, Σπ², a row mask, and
gradients; at V = 16384 and 50257 too) is
compiled by :mod:`tests.gpu._build`, one subprocess per target (triton's active driver is
process-wide), and the cubin and PTX are read back. A target whose ``ptxas`` the wheel lacks
(``ptxas-blackwell`` from sm_90 on) is skipped. Asserted, on every target: every call builds; no
spills
(``STACK 0``, no local memory); shared memory within the target's per-block limit; every grid
within CUDA's limits, at T = 2²¹ with 16-step blocks too (131,072 blocks of time, beyond the
65,535 of grid dimension 1); vector global loads in the scan and estimator kernels; and on the
logits tile at V = 50280 (divisible by 8, not 16) as few scalar 16-bit loads as at an aligned
vocabulary (none: the target's gather is the merge kernel's); the log-prob grids of the
vocabulary split; the row-mask variants; and that the scan family's launches do not depend on
the number of rows (one block of time, one layout: batch invariance).
"""

from __future__ import annotations

import pytest

# (sets TRITON_INTERPRET=1 before triton is imported, as every Triton test file does: the kernels
# this process imports stay the interpreter's for the tests after this one; the builds run in
# subprocesses without it)
from tests._triton_interp import triton  # noqa: F401
from tests.gpu._build import GRID_LIMIT, TARGETS, build_targets

NVIDIA = [name for name, t in TARGETS.items() if t.backend == "cuda"]
ARCHS = [
    pytest.param(name, marks=pytest.mark.skip(reason=f"this triton wheel lacks {why}"))
    if (why := TARGETS[name].missing())
    else name
    for name in NVIDIA
]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    return build_targets([name for name in NVIDIA if TARGETS[name].missing() is None])


def _kernels(rows, arch):
    return [r for r in rows[arch] if "error" not in r]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_public_call_builds(rows, arch):
    errors = [f"{r['case']}: {r['error']}" for r in rows[arch] if "error" in r]
    assert not errors, "\n".join(errors)
    cases = {r["case"] for r in rows[arch]}
    assert len(cases) >= 30, sorted(cases)
    for r in rows[arch]:  # every gradient case built its backward kernel as well
        if r["case"].startswith("logprobs") and "fwd+bwd" in r["case"]:
            names = {k["kernel"] for k in rows[arch] if k["case"] == r["case"]}
            merged = "V=16384" not in r["case"]  # more than one vocabulary slice
            want = {"_stats_kernel", "_grad_kernel"} | ({"_merge_kernel"} if merged else set())
            assert names == want, (r["case"], names)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_spills_and_shared_memory_within_the_limit(rows, arch):
    for r in _kernels(rows, arch):
        if r["dup"]:
            continue
        where = f"{r['kernel']} ({r['case']}, {arch})"
        assert r["stack"] == 0 and r["local"] == 0, f"{where} spills: {r}"
        shared = r["shared"] + r["dyn_shared"]  # static (cubin) + dynamic (launch)
        assert shared <= TARGETS[arch].shared_limit, f"{where} shared memory {shared} B"


@pytest.mark.parametrize("arch", ARCHS)
def test_grids_within_the_limits_at_two_million_steps(rows, arch):
    for r in _kernels(rows, arch):
        grid = list(r["grid"]) + [1] * (3 - len(r["grid"]))
        assert all(1 <= g <= lim for g, lim in zip(grid, GRID_LIMIT, strict=True)), r
    long = [r for r in _kernels(rows, arch) if "block_t=16" in r["case"]]
    assert max(r["grid"][0] for r in long if r["kernel"] == "_scan_block") == 2**21 // 16


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scan_and_estimator_kernels_load_vectors(rows, arch):
    for r in _kernels(rows, arch):
        if r["dup"] or r["kernel"] not in ("_scan_block", "_estimator_block"):
            continue
        if "block_t=16" in r["case"]:  # 16 steps over 128 threads: one element each
            continue
        assert r["ld_bits"] >= 64, f"{r['kernel']} ({r['case']}): scalar loads only"
        if "mask" not in r["case"] and "float64" not in r["case"]:
            assert r["ld_bits"] == 128, f"{r['kernel']} ({r['case']}): {r['ld_bits']}-bit"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_scalar_half_loads_on_the_logits_tile_at_v_50280(rows, arch):
    """At V = 50280 the kernels that read the logits tile load it as 128-bit vectors, with as
    many scalar 16-bit loads as at V = 151936 (divisible by 16): none (the target logit's
    gather is the merge kernel's, which reads per-row numbers only)."""
    built = {(r["case"], r["kernel"]): r for r in _kernels(rows, arch)}
    checked = 0
    for (case, kernel), r in built.items():
        if "V=50280" not in case or r["dup"] or kernel == "_merge_kernel":
            continue
        aligned = built[(case.replace("V=50280", "V=151936"), kernel)]
        assert r["ld_bits"] == 128, f"{kernel} ({case}): {r['ld_bits']}-bit loads"
        assert r["ld16_scalar"] == aligned["ld16_scalar"] <= 1, (case, kernel, r, aligned)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("arch", ARCHS)
def test_the_vocabulary_split_builds(rows, arch):
    """Above one slice (16384 logits) the statistics kernel writes its slices' accumulators, a
    program per slice (at V = 151936 a grid of (N, 10)), and the merge kernel folds them; at
    V = 16384 one kernel writes the statistics. At N = 4 the gradient's programs take a tile
    each (38 per row at V = 151936)."""
    built = _kernels(rows, arch)
    for r in built:
        if not r["case"].startswith("logprobs") or r["kernel"] == "_merge_kernel":
            continue
        v = int(r["case"].split("V=")[1].split()[0])
        tiles = -(-v // 4096)
        want = -(-tiles // 4) if r["kernel"] == "_stats_kernel" else tiles
        assert tuple(r["grid"]) == (4, want), r
    merges = [r for r in built if r["kernel"] == "_merge_kernel" and not r["dup"]]
    assert merges and all(r["stack"] == 0 for r in merges)
    assert not any(r["kernel"] == "_merge_kernel" for r in built if "V=16384" in r["case"])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_row_mask_builds_its_own_kernels(rows, arch):
    """``mask=`` launches kernels of their own (the masked rows' early return), which build,
    without spills, and still load the logits tile as 128-bit vectors."""
    built = [r for r in _kernels(rows, arch) if "row mask" in r["case"]]
    assert {r["kernel"] for r in built} == {"_stats_kernel", "_merge_kernel", "_grad_kernel"}
    fresh = [r for r in built if not r["dup"] and r["kernel"] != "_merge_kernel"]
    assert len(fresh) >= 4, built
    assert all(r["ld_bits"] == 128 for r in fresh), fresh


@pytest.mark.parametrize("arch", ARCHS)
def test_an_odd_vocabulary_of_aligned_rows_loads_vectors(rows, arch):
    """V = 50257 as a view of rows padded to 50304: the tiles inside V load as 128-bit vectors
    (the last, partial tile is peeled: its 16 scalar loads per thread are the only ones). Rows
    of 50257 contiguous logits start misaligned and stay scalar (docs/gpu.md: a peel of each
    row's head would make a row's bits depend on its position)."""
    built = {(r["case"], r["kernel"]): r for r in _kernels(rows, arch) if not r["dup"]}
    padded = "logprobs_and_entropy V=50257 row stride 50304 bfloat16 plain fwd+bwd"
    dense = "logprobs_and_entropy V=50257 bfloat16 plain fwd+bwd"
    for kernel in ("_stats_kernel", "_grad_kernel"):
        r, d = built[(padded, kernel)], built[(dense, kernel)]
        assert r["ld_bits"] == 128, (kernel, r)
        assert r["ld16_scalar"] <= d["ld16_scalar"], (kernel, r, d)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scan_family_launches_one_layout(rows, arch):
    """Every ``_scan_block`` / ``_estimator_block`` of the default block launches 256-step
    blocks (the grid is rows × ⌈T / 256⌉, whatever the rows: 8 × 512 at T = 131072, 1 × 8192 at
    T = 2²¹) with the warps of its carries' width alone (16 bytes a thread: two warps for
    float32, four for float64), and so does every ``_carry_kernel``: a row's reduction order does
    not follow the batch."""
    scan = [r for r in _kernels(rows, arch) if r["kernel"] in ("_scan_block", "_estimator_block")
            and "block_t=16" not in r["case"]]  # fmt: skip
    for r in scan:
        rows_, t = (1, 2**21) if "2^21" in r["case"] else (8, 131072)
        assert tuple(r["grid"]) == (rows_ * t // 256,), r
    built = [r for r in _kernels(rows, arch) if not r["dup"] and "block_t=16" not in r["case"]]
    for r in built:
        if r["kernel"] in ("_scan_block", "_estimator_block", "_carry_kernel"):
            assert r["num_warps"] == (4 if "float64" in r["case"] else 2), r
