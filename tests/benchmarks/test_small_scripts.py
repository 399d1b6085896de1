"""The small benchmark scripts run (tiny shapes), so that they cannot rot: the chunked scan
beside a busy process (``benchmarks/threads.py``) and the error table of the policy-loss kinds
(``benchmarks/kinds_error.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ is not shipped here"
)


def _run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout


def test_threads_prints_a_ratio_per_function_and_shape():
    out = _run(
        "benchmarks/threads.py", "--shapes", "2x64", "--rounds", "1", "--calls", "2", "--no-busy"
    )
    lines = [line.split() for line in out.splitlines()[2:]]
    assert [(w[0], w[1]) for w in lines] == [("gae", "2x64"), ("discounted_cumsum", "2x64")]
    assert all(float(w[-1]) > 0 for w in lines)


def test_kinds_error_prints_every_kind():
    out = _run("benchmarks/kinds_error.py", "--rows", "2", "--len", "9")
    for kind in ("luspo", "vespo", "dppo_tv", "dppo_kl", "dro"):
        assert kind in out, kind
