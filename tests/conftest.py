"""Test-suite settings.

**Tiers.** ``python -m pytest -q -n 2`` runs everything (CI runs it). ``python -m pytest -q -n 2
-m "not slow"`` is the inner loop: every module at small shapes, without the files listed in
:data:`SLOW_FILES` (the Triton interpreter's big sweeps, Inductor builds, the sm_90 compiler
builds, the benchmark scripts, TRL's trainer) and without the cases a test file marks
``slow`` itself. Each file here is slow as a whole: a small test of the same module stays in
the fast tier (the Triton kernels: ``tests/logprobs/test_mask_triton.py``,
``tests/testing/test_batch_invariance_triton.py``; TRL: ``tests/compat/test_trl_lazy.py``).

**Property tests** explore new random examples on every local run; under CI (``CI`` set, as
``.ci/run`` is run) they replay a fixed sequence, so a submission's result does not depend on
which examples one run happened to draw. Counterexamples found locally become fixes and, where
useful, explicit ``@example`` cases.

**Triton** runs under its CPU interpreter everywhere in the suite (``TRITON_INTERPRET=1``, set
below before anything imports a kernel); the GPU build tests build for real targets apart.

**pytest-xdist** (``-n 2``): each worker compiles into its own Inductor cache, so two workers
never write the same cache entry at once.
"""

import os
import tempfile
from pathlib import Path

# Triton decides between its interpreter and a real build when a kernel is decorated, from
# TRITON_INTERPRET as first read: set it before any test module (or a peer such as TRL, which
# imports triton itself) imports a kernel module, so that a subset of the suite run in any
# order gets the interpreter as the whole suite does (tests/_triton_interp.py sets it too)
os.environ["TRITON_INTERPRET"] = "1"

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"rlops_inductor_{_worker}")
    )

TESTS = Path(__file__).resolve().parent

#: test files that are slow as a whole (relative to tests/): the full suite only
SLOW_FILES = {
    "advantages/test_bootstrap_triton.py",
    "advantages/test_triton.py",
    "benchmarks/test_gpu.py",
    "benchmarks/test_logprobs.py",
    "benchmarks/test_small_scripts.py",
    "cli/test_bench.py",
    "compat/test_trl.py",
    "compat/test_trl_distributed.py",
    "gpu/test_sm90_build.py",
    "logprobs/test_triton.py",
    "scan/test_triton.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        except ValueError:  # a doctest under src/
            continue
        if rel in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
