"""``benchmarks/gpu.py``: the prepared GPU check imports and answers ``--help`` on CPU; with
``--dry-run`` it runs on CPU under the Triton interpreter at tiny shapes, section by section
(copy bandwidth, correctness, host syncs, batch invariance, timings at two shapes), passes its
own correctness and invariance rules and writes its report; a section that raises is reported
and the others still run, and a process killed in a section leaves the report of the sections
before it (the JSON is written after every section). Its checkers are tested on known-good and
known-bad inputs: the batch-invariance check flags a row that depends on the batch (its mean,
a last-bit difference, padding that counts) and passes one that does not (values compared as
``torch.equal`` does: NaN equals NaN, zeros of either sign are equal); the timing interleaves
its variants and keeps going past one that raises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("copy_bandwidth", "correctness_gae", "correctness_logprobs", "host_syncs",
            "batch_invariance", "timings_gae", "timings_logprobs")  # fmt: skip


@pytest.fixture(scope="module")
def gpu():
    """benchmarks/gpu.py as a module (the Triton interpreter on: CPU tensors take the kernels)."""
    from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

    spec = importlib.util.spec_from_file_location("rlops_bench_gpu", ROOT / "benchmarks/gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--help"],
                          capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and all(name in proc.stdout for name in SECTIONS)


def test_sections_in_order(gpu):
    assert gpu.SECTIONS == SECTIONS


def test_the_invariance_check_flags_a_batch_dependent_row(gpu):
    import torch

    cfg = {"inv_rows": (0, 2, 4), "inv_batches": (1, 3, 6)}
    data = {"x": torch.randn(6, 12, generator=torch.Generator().manual_seed(0))}
    ok = gpu._invariance(lambda d: (d["x"].cumsum(1),), data, 8, cfg, {"x": 0.0})
    assert ok["bitwise"] and set(ok["max_abs_diff"]) == {"B=3", "B=6", "padded"}
    assert all(v == 0.0 for v in ok["max_abs_diff"].values())
    # the batch's mean leaks into every row: caught at every batch size
    leak = gpu._invariance(lambda d: (d["x"] - d["x"].mean(),), data, 8, cfg, None)
    assert not leak["bitwise"] and all(v > 0 for v in leak["max_abs_diff"].values())
    # a reduction order that follows the batch: a tiny difference, still caught
    order = gpu._invariance(lambda d: (d["x"] * (1 + 1e-7 * (d["x"].shape[0] > 1)),), data, 8,
                            cfg, None)  # fmt: skip
    assert not order["bitwise"]
    # padding that counts (the sum runs past T): caught on the padded comparison only
    pad = gpu._invariance(lambda d: (d["x"].flip(1).cumsum(1).flip(1),), data, 8, cfg,
                          {"x": 1.0})  # fmt: skip
    assert pad["max_abs_diff"]["padded"] > 0 and pad["max_abs_diff"]["B=6"] == 0.0
    # compared as torch.equal compares: a zero of either sign, NaN for NaN
    assert gpu._diff([torch.tensor([-0.0])], [torch.tensor([0.0])]) == 0.0
    assert gpu._diff([torch.tensor([float("nan")])], [torch.tensor([float("nan")])]) == 0.0


def test_timing_interleaves_and_keeps_going_past_an_error(gpu):
    import torch

    calls = []

    def fail():
        calls.append("C")
        raise RuntimeError("boom")

    out = gpu.timed_many({"A": lambda: calls.append("A"), "B": lambda: calls.append("B"),
                          "C": fail}, torch.device("cpu"), 3)  # fmt: skip
    assert calls == ["A", "B", "C"] + ["A", "B"] * 3  # warm-ups, then one window each in turn
    assert out["A"] >= 0 and out["B"] >= 0 and isinstance(out["C"], RuntimeError)


def test_host_syncs_on_cpu_run_the_calls_and_count_nothing(gpu):
    import torch

    ran = []
    assert gpu._count_syncs(lambda: ran.append(1), torch.device("cpu")) == {
        "syncs": None,
        "error_mode_ok": None,
    }
    assert ran == [1]

    def oom():
        raise torch.OutOfMemoryError("out of memory")

    assert gpu._count_syncs(oom, torch.device("cpu"))["error"].startswith("OutOfMemoryError")


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
    assert list(report["section_seconds"]) == list(SECTIONS)
    gae = report["timings_gae"]
    assert list(gae) == ["2x256", "1x300"]  # as 256 x 131072 and 8 x 131072 on a device
    scan = "triton scan (discounted_cumsum)"
    for rows in gae.values():
        for name in ("triton", "chunked", "chunk loop (trainers')", scan):
            assert rows[name]["seconds"] > 0 and rows[name]["fraction_of_copy_bandwidth"] > 0
    for name in ("triton", scan):  # the cost of batch invariance: against 1024-step blocks
        assert gae["2x256"][f"{name} block_t=1024"]["seconds"] > 0
        assert gae["2x256"][name]["time_over_1024_step_blocks"] > 0
    lp = report["timings_logprobs"]
    for name in ("log_softmax + gather", "triton logp + entropy", "chunked logp + entropy"):
        assert lp[name]["seconds"] > 0
    syncs = report["host_syncs"]
    assert len(syncs) == 10 and {k.rsplit(" ", 1)[1] for k in syncs} == {"triton", "chunked"}
    assert all(r == {"syncs": None, "error_mode_ok": None} for r in syncs.values())  # CPU
    inv = report["batch_invariance"]
    assert len(inv) == 6 and any(k.startswith("logprobs") for k in inv)
    for name, r in inv.items():
        assert r["bitwise"], (name, r)
        assert {"B=3", "B=8"} <= set(r["max_abs_diff"]), (name, r)
    assert sum("padded" in r["max_abs_diff"] for r in inv.values()) == 4
    assert set(report["goals"]) == {
        "scan >= 50% of copy bandwidth",
        "fused fwd+bwd <= 1.2x log_softmax + gather",
        "fused extra memory <= 0.1x log_softmax + gather",
        "no host sync in any call",
    }
    assert report["goals"]["no host sync in any call"] is None  # nothing counted on CPU
    assert "correct: all cases within the rule" in proc.stdout
    assert "batch invariance: bitwise in every case" in proc.stdout


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
    assert report["batch_invariance"] and report["host_syncs"]
    assert report["timings_gae"]["2x256"]["triton"]["seconds"] > 0
    assert "timings_logprobs" not in report  # the process ended there
