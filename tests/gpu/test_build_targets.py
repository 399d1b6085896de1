"""rlops's Triton kernels built for AMD's gfx942 (MI300X) and gfx950 (MI355X), on CPU.

The same public calls as ``test_sm90_build.py`` (every kernel variant at production shapes)
compiled by :mod:`tests.gpu._build` for ``GPUTarget("hip", arch, 64)``, one subprocess per
target, and the AMDGPU assembly's metadata read back. ``method="auto"`` never picks these
kernels on ROCm (docs/gpu.md, "ROCm"); ``method="triton"`` does, so this is what an explicit
call compiles to. Asserted: every call builds; wave64; no VGPR or SGPR spills and no scratch;
at most 128 VGPRs (four waves per SIMD); LDS within the target's limit; work-items within
2³² − 1 per grid dimension; vector global loads (``global_load_dwordx4``, 128-bit) in the
scan family's kernels and on the logits tile at V = 50280 and at V = 50257 in rows padded to
50304; the scan family's grids and warps independent of the number of rows.
"""

from __future__ import annotations

import pytest

# (sets TRITON_INTERPRET=1 before triton is imported; the builds run in subprocesses without it)
from tests._triton_interp import triton  # noqa: F401
from tests.gpu._build import GRID_LIMIT, TARGETS, build_targets

pytestmark = pytest.mark.slow  # two compiler builds of every kernel: about a minute each

AMD = [name for name, t in TARGETS.items() if t.backend == "hip"]
ARCHS = [
    pytest.param(name, marks=pytest.mark.skip(reason=f"this triton wheel lacks {why}"))
    if (why := TARGETS[name].missing())
    else name
    for name in AMD
]
MAX_VGPRS = 128  # 512 VGPRs per SIMD lane on CDNA3 / CDNA4: four waves of 128 per SIMD


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    return build_targets([name for name in AMD if TARGETS[name].missing() is None])


def _built(rows, arch):
    return [r for r in rows[arch] if "error" not in r and not r["dup"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_public_call_builds(rows, arch):
    errors = [f"{r['case']}: {r['error']}" for r in rows[arch] if "error" in r]
    assert not errors, "\n".join(errors)
    assert len({r["case"] for r in rows[arch]}) >= 30
    names = {r["kernel"] for r in rows[arch]}
    assert names == {"_scan_block", "_carry_kernel", "_estimator_block", "_stats_kernel",
                     "_merge_kernel", "_grad_kernel"}, names  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_wave64_no_spills_no_scratch_and_lds_within_the_limit(rows, arch):
    for r in _built(rows, arch):
        where = f"{r['kernel']} ({r['case']}, {arch})"
        assert r["wavefront"] == 64, f"{where}: wave{r['wavefront']}"
        assert r["vgpr_spills"] == r["sgpr_spills"] == r["scratch"] == 0, f"{where} spills: {r}"
        assert r["regs"] <= MAX_VGPRS, f"{where}: {r['regs']} VGPRs"
        lds = r["shared"] + r["dyn_shared"]
        assert lds <= TARGETS[arch].shared_limit, f"{where}: {lds} B of LDS"


@pytest.mark.parametrize("arch", ARCHS)
def test_grids_within_the_limits(rows, arch):
    for r in rows[arch]:
        if "error" in r:
            continue
        grid = list(r["grid"]) + [1] * (3 - len(r["grid"]))
        assert all(1 <= g <= lim for g, lim in zip(grid, GRID_LIMIT, strict=True)), r
    for r in _built(rows, arch):  # HIP counts the grid in work-items: < 2³² per dimension
        assert r["grid"][0] * r["num_warps"] * 64 < 2**32, r


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scan_family_loads_vectors_with_one_layout(rows, arch):
    """128-bit loads (``global_load_dwordx4``: four float32 per lane, one wave of 64 lanes per
    256-step block; two float64 per lane, two waves); grids of rows × ⌈T / 256⌉ and the waves
    of the carries' width whatever the rows."""
    scan = [r for r in _built(rows, arch) if r["kernel"] in ("_scan_block", "_estimator_block")
            and "block_t=16" not in r["case"]]  # fmt: skip
    assert len(scan) >= 20
    for r in scan:
        assert r["ld_bits"] == 128, f"{r['kernel']} ({r['case']}): {r['ld_bits']}-bit loads"
        rows_, t = (1, 2**21) if "2^21" in r["case"] else (8, 131072)
        assert tuple(r["grid"]) == (rows_ * t // 256,), r
    for r in _built(rows, arch):
        if r["kernel"] in ("_scan_block", "_estimator_block", "_carry_kernel"):
            if "block_t=16" not in r["case"]:
                assert r["num_warps"] == (2 if "float64" in r["case"] else 1), r


@pytest.mark.parametrize("arch", ARCHS)
def test_the_logits_tile_loads_vectors(rows, arch):
    """The statistics and gradient kernels load the logits tile as 128-bit vectors at
    V = 151936, at V = 50280 (divisible by 8, not 16) and at V = 50257 in rows padded to
    50304; contiguous rows of 50257 start misaligned and stay narrower (docs/gpu.md)."""
    tile = [r for r in _built(rows, arch) if r["kernel"] in ("_stats_kernel", "_grad_kernel")]
    checked = 0
    for r in tile:
        if "V=50257 bfloat16" in r["case"]:  # contiguous odd rows: misaligned
            continue
        assert r["ld_bits"] == 128, f"{r['kernel']} ({r['case']}): {r['ld_bits']}-bit loads"
        checked += 1
    assert checked >= 40
