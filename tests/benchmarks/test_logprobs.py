"""``benchmarks/logprobs.py`` on tiny shapes: every variant is measured, every ratio is computed
from this run's measurements, the report and the JSON carry them, the options parse."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "logprobs.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks_logprobs", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()

LINEAR_VARIANTS = [
    "materialised + fused",
    "fused linear",
    "materialised + keep mask",
    "fused linear top-p",
]
LINEAR_RATIOS = [
    f"{a} / {b}, {what}"
    for a, b in (
        ("fused linear", "materialised + fused"),
        ("fused linear top-p", "materialised + keep mask"),
    )
    for what in ("time", "peak extra memory")
]
LOGITS_VARIANTS = [
    "log_softmax + gather + entropy",
    "fused logits",
    "log_softmax + gather + entropy, contention 1",
    "fused logits, contention 1",
]
LOGITS_RATIOS = [
    "fused logits / unfused, time",
    "fused logits / unfused, peak extra memory",
    "fused logits / unfused, time, contention 1",
    "unfused, time, contention 1 / quiet",
    "fused logits, time, contention 1 / quiet",
]


@pytest.fixture(scope="module")
def result():
    seen = []
    res = bench.run(
        linear=[(128, 256)],
        hidden=[16],
        dtype=["float32"],
        logits=[(64, 256)],
        threads=[1],
        contention=1,
        top_p=0.9,
        on_case=seen.append,
    )
    assert seen == res["cases"]
    return res


def test_every_variant_and_ratio_is_measured(result):
    linear, logits = result["cases"]
    assert linear["kind"] == "linear" and logits["kind"] == "logits"
    assert list(linear["variants"]) == LINEAR_VARIANTS
    assert list(linear["ratios"]) == LINEAR_RATIOS
    assert list(logits["variants"]) == LOGITS_VARIANTS
    assert list(logits["ratios"]) == LOGITS_RATIOS
    for case in result["cases"]:
        for m in case["variants"].values():
            assert m["time_s"] > 0 and m["peak_extra_bytes"] >= 0
    v = linear["variants"]
    ratio = linear["ratios"]["fused linear / materialised + fused, time"]
    assert ratio == v["fused linear"]["time_s"] / v["materialised + fused"]["time_s"]
    v = logits["variants"]
    ratio = logits["ratios"]["fused logits, time, contention 1 / quiet"]
    assert ratio == v["fused logits, contention 1"]["time_s"] / v["fused logits"]["time_s"]
    assert result["config"]["contention"] == 1 and result["config"]["linear"] == [[128, 256]]


def test_report_has_every_case_variant_and_ratio(result):
    text = bench.report(result)
    assert "linear N=128 V=256 H=16 float32, top_p=0.9, torch threads=1" in text
    assert "logits T=64 V=256 float32, torch threads=1" in text
    for name in LINEAR_VARIANTS + LINEAR_RATIOS + LOGITS_VARIANTS + LOGITS_RATIOS:
        assert name in text
    summary = bench.summary(result)
    for name in LINEAR_RATIOS + LOGITS_RATIOS:
        assert name in summary
    json.dumps(result)


def test_zero_memory_baseline_is_not_a_ratio():
    variants = {"a": {"peak_extra_bytes": 4.0}, "b": {"peak_extra_bytes": 0.0}}
    assert bench._ratio(variants, "a", "b", "peak_extra_bytes") is None
    case = {
        "title": "t",
        "variants": {"a": {"time_s": 1e-3, "peak_extra_bytes": 0.0}},
        "ratios": {"a / b": None},
    }
    assert "n/a" in bench.case_report(case)


def test_main_picks_sections_dtype_and_sizes(tmp_path, capsys):
    path = tmp_path / "lp.json"
    argv = "--sections top-p --linear 64x128 --hidden 8 --dtype bfloat16 --logits 16x64"
    res = bench.main([*argv.split(), "--threads", "1", "--top-p", "0.5", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(res))
    config = saved["config"]
    assert config["sections"] == ["top-p"] and not config["quick"] and config["contention"] == 0
    assert config["logits"] == [[16, 64]] and config["threads"] == [1]
    (linear,) = saved["cases"]  # the logits section not chosen
    assert list(linear["variants"]) == ["materialised + keep mask", "fused linear top-p"]
    assert list(linear["ratios"]) == LINEAR_RATIOS[2:]
    assert linear["shape"] == {"n": 64, "v": 128, "h": 8, "dtype": "bfloat16", "top_p": 0.5}
    out = capsys.readouterr().out
    assert "linear N=64 V=128 H=8 bfloat16, top_p=0.5" in out and "ratios (" in out


def test_contention_processes_spin_during_the_block_and_are_killed_after():
    with bench.contention(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with bench.contention(0) as procs:
        assert procs == []


def test_quick_and_full_defaults_cover_the_grid():
    assert bench.FULL["linear"] == [(8192, 32000), (2048, 151936)]
    assert bench.FULL["hidden"] == [512, 2048]
    assert bench.FULL["dtype"] == ["float32", "bfloat16"]
    assert bench.FULL["logits"] == [(2048, 32000), (4096, 32000)]
    for action in bench.parser()._actions:
        if action.dest not in ("help", "quick", "json"):
            assert "(default" in action.help, action.dest


@pytest.mark.parametrize(
    "argv",
    [
        ["--linear", "8192"],
        ["--linear", "0x5"],
        ["--hidden", "0"],
        ["--dtype", "int8"],
        ["--threads", "0"],
        ["--contention", "-1"],
        ["--top-p", "0"],
        ["--top-p", "1.5"],
        ["--sections", "nothing"],
        ["--json", "/nonexistent-folder/x.json"],
    ],
)
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench.parser().parse_args(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err
