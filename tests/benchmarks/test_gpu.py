"""``benchmarks/gpu.py --dry-run``: the prepared GPU check runs on CPU under the Triton
interpreter at tiny shapes, passes its own correctness rule and writes its report; a section
that raises is reported and the others still run, and a process killed in a section leaves
the report of the sections before it (the JSON is written after every section)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _dry_run(tmp_path, *extra, out=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    env.pop("OUT", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", *extra]
    if out is not None:
        cmd += ["--json", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)  # fmt: skip


def test_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _dry_run(tmp_path, out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["errors"] == {}
    cases = [r["case"] for r in report["correctness_gae"] + report["correctness_logprobs"]]
    assert any(c.startswith("gae") and "triton" in c for c in cases)
    assert any(c.startswith("logprobs") and "bfloat16" in c for c in cases)
    assert all(r["pass"] for r in report["correctness_gae"] + report["correctness_logprobs"])
    gae = report["timings_gae"]
    for name in ("triton", "chunked", "chunk loop (trainers')", "triton scan (discounted_cumsum)"):
        assert gae[name]["seconds"] > 0 and gae[name]["fraction_of_copy_bandwidth"] > 0
    lp = report["timings_logprobs"]
    for name in ("log_softmax + gather", "triton logp + entropy", "chunked logp + entropy"):
        assert lp[name]["seconds"] > 0
    assert set(report["goals"]) == {
        "scan >= 50% of copy bandwidth",
        "fused fwd+bwd <= 1.2x log_softmax + gather",
        "fused extra memory <= 0.1x log_softmax + gather",
    }
    assert "correct: all cases within the rule" in proc.stdout


def test_a_failing_section_keeps_the_others_and_a_kill_keeps_those_before(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env_out = {"OUT": str(out)}  # --json defaults to $OUT/gpu.json
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run",
         "--fail-section", "correctness_gae", "--kill-section", "timings_logprobs"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", **env_out),
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr  # killed in timings_logprobs
    report = json.loads((out / "gpu.json").read_text())
    assert report["errors"] == {"correctness_gae": "RuntimeError: --fail-section correctness_gae"}
    assert report["correctness_gae"] is None
    assert report["copy_bandwidth"] > 0  # the section before the failure
    assert all(r["pass"] for r in report["correctness_logprobs"])  # and those after it
    assert report["timings_gae"]["triton"]["seconds"] > 0
    assert "timings_logprobs" not in report  # the process ended there
