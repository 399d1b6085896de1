"""``benchmarks/gpu.py --dry-run``: the prepared GPU check runs on CPU under the Triton
interpreter at tiny shapes, passes its own correctness rule and writes its report."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    cases = [r["case"] for r in report["correctness"]]
    assert any(c.startswith("gae") and "triton" in c for c in cases)
    assert any(c.startswith("logprobs") and "bfloat16" in c for c in cases)
    assert all(r["pass"] for r in report["correctness"])
    gae = report["timings"]["gae"]
    for name in ("triton", "chunked", "chunk loop (trainers')", "triton scan (discounted_cumsum)"):
        assert gae[name]["seconds"] > 0 and gae[name]["fraction_of_copy_bandwidth"] > 0
    lp = report["timings"]["logprobs"]
    for name in ("log_softmax + gather", "triton logp + entropy", "chunked logp + entropy"):
        assert lp[name]["seconds"] > 0
    assert set(report["goals"]) == {
        "scan >= 50% of copy bandwidth",
        "fused fwd+bwd <= 1.2x log_softmax + gather",
        "fused extra memory <= 0.1x log_softmax + gather",
    }
    assert "correct: all cases within the rule" in proc.stdout
