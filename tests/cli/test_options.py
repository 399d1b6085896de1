"""The ``rlops`` command line: version, help texts, option checks made before any measurement
(unknown options, output paths, matplotlib), explicit options over ``--quick``, tables printed
as each section completes, verdict wording (``rlops profile``'s included)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

import rlops
from rlops.cli import bench, demo, main, parser, profile
from rlops.measure import sections


def test_version(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--version"])
    assert err.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlops {rlops.__version__}"


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_help_is_plain_and_shows_every_default(command):
    sub = subparsers()[command]
    text = sub.format_help()
    assert "``" not in text and ":class:" not in text
    for action in sub._actions:
        if action.help in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
            continue
        if action.default not in (None, False) or action.dest in bench.DEFAULTS:
            assert "default" in action.help, f"rlops {command} {action.option_strings[0]}"


@pytest.mark.parametrize("command", ["bench", "profile"])
@pytest.mark.parametrize("name", ["gpu", "tpu9", "cuda:x", "meta"])
def test_unknown_device_is_a_usage_error(command, name, capsys):
    with pytest.raises(SystemExit) as err:
        main([command, "--device", name])
    assert err.value.code == 2
    text = capsys.readouterr().err
    assert f"rlops {command}: error: argument --device" in text and "Traceback" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("command", ["bench", "profile"])
def test_absent_cuda_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as err:
        main([command, "--device", "cuda"])
    assert err.value.code == 2
    assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_fails_before_measuring(command, option, tmp_path, capsys):
    for path in (tmp_path / "no-such-folder" / "out", tmp_path):  # missing folder; a folder
        with pytest.raises(SystemExit) as err:
            main([command, option, str(path)])
        assert err.value.code == 2
        assert f"argument {option}: " in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_output_in_a_folder_that_takes_no_files_fails_before_measuring(command, capsys):
    """``/proc`` exists and os.access may call it writable, but no file can be made there."""
    with pytest.raises(SystemExit) as err:
        main([command, "--json", "/proc/x.json"])
    assert err.value.code == 2
    assert "argument --json: cannot write '/proc/x.json'" in capsys.readouterr().err


def test_an_output_check_leaves_no_file_behind(tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("kept")
    args = parser().parse_args(["bench", "--json", str(new)])
    assert args.json == str(new) and not new.exists()
    parser().parse_args(["bench", "--json", str(old)])
    assert old.read_text() == "kept"


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_plot_path_gets_the_png_it_is_written_as(command, tmp_path):
    args = parser().parse_args([command, "--plot", str(tmp_path / "xnoext")])
    assert args.plot == str(tmp_path / "xnoext.png")
    args = parser().parse_args([command, "--plot", str(tmp_path / "x.PNG")])
    assert args.plot == str(tmp_path / "x.PNG")


def test_demo_plot_without_extension_says_where_it_wrote(tmp_path, capsys):
    argv = ["demo", "--iterations", "2", "--batch", "4", "--length", "4"]
    assert main([*argv, "--plot", str(tmp_path / "xnoext")]) == 0
    assert os.listdir(tmp_path) == ["xnoext.png"]
    assert f"saved to {tmp_path / 'xnoext.png'}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_plot_without_matplotlib_fails_before_measuring(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    for module in (bench, demo, profile):
        monkeypatch.setattr(module, "run", lambda args: pytest.fail("measured"))
    with pytest.raises(SystemExit) as err:
        main([command, "--plot", str(tmp_path / "p.png")])
    assert err.value.code == 2
    err = capsys.readouterr().err
    assert "argument --plot: drawing needs matplotlib" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_an_unknown_option_shows_the_subcommands_usage(command, capsys):
    with pytest.raises(SystemExit) as err:
        main([command, "--quik"])
    assert err.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: rlops {command} ")
    assert f"rlops {command}: error: unrecognized arguments: --quik" in err


def test_explicit_options_win_over_quick(tmp_path, capsys):
    path = tmp_path / "b.json"
    argv = ["bench", "--quick", "--sections", "group", "--seq-len", "48", "--group-batch", "16"]
    assert main([*argv, "--repeats", "2", "--json", str(path)]) == 0
    config = json.loads(path.read_text())["config"]
    assert config["seq_len"] == [48] and config["group_batch"] == 16 and config["repeats"] == 2
    assert config["vocab"] == bench.QUICK["vocab"]  # not given: the --quick default
    assert "grpo [16x48]" in capsys.readouterr().out


def test_logprob_options_reach_the_section(monkeypatch):
    """--hidden and --top-p go to the log-prob section; --hidden falls back to the --quick size."""
    seen = []

    def logprobs(tokens, vocab, **kwargs):
        seen.append((tokens, vocab, kwargs["hidden"], kwargs["top_p"]))
        return []

    monkeypatch.setattr(sections, "bench_logprobs", logprobs)
    argv = ["bench", "--quick", "--sections", "logprobs", "--logprob-tokens", "16"]
    assert main([*argv, "--hidden", "24", "--top-p", "0.5"]) == 0
    assert main(argv) == 0
    assert seen == [([16], 4096, 24, 0.5), ([16], 4096, bench.QUICK["hidden"], 0.9)]


def test_each_section_is_printed_when_it_completes(monkeypatch, capsys):
    """The group table is out before the log-prob section starts."""
    seen = []

    def logprobs(*args, **kwargs):
        seen.append(capsys.readouterr().out)
        return []

    monkeypatch.setattr(sections, "bench_logprobs", logprobs)
    argv = ["bench", "--quick", "--sections", "group", "logprobs", "--seq-len", "32"]
    assert main([*argv, "--group-batch", "16", "--repeats", "1"]) == 0
    assert "grpo [16x32]" in seen[0] and "rloo [16x32]" in seen[0]


def test_bench_verdict_compares_measured_shapes_only():
    rows = [
        sections.Row("advantages", "gae", 64, "2x64", "per-token loop", 2e-3),
        sections.Row("advantages", "gae", 64, "2x64", "rlops auto", 1e-5, ours=True),
        sections.Row("advantages", "gae", 64, "2x64", "memory floor", 5e-6),
        sections.Row("logprobs", "log-prob + entropy", 8, "8x16", "unfused", 2e-4),
        sections.Row("logprobs", "log-prob + entropy", 8, "8x16", "rlops fused", 1e-4, True),
    ]
    lines = bench.verdicts(rows)
    assert lines[0] == (
        "- gae [2x64]: per-token loop 2.000 ms -> 0.010 ms (200x faster). "
        "rlops runs at 2.0x the memory floor."
    )
    assert "For scale" not in " ".join(lines)
    assert lines[1].startswith("- log-prob + entropy [8x16], forward + backward: 0.200 ms")


def stage_results(naive: dict, ours: dict) -> dict:
    """``{impl: {stage: {"seconds", "peak_bytes"}}}`` from ``{stage: (ms, MiB)}``."""
    out = {}
    for impl, given in (("naive", naive), ("rlops", ours)):
        out[impl] = {
            s: {
                "seconds": given.get(s, (1.0, 1.0))[0] / 1e3,
                "peak_bytes": given.get(s, (1, 1))[1] * 2**20,
            }
            for s in profile.STAGES
        }
    return out


def test_profile_verdict_shows_time_in_ms_and_memory_in_mib():
    """The stage that saves most memory here is slower: its line speaks of memory only."""
    result = stage_results(
        {"backward": (1809.2, 900.0), "advantages": (50.0, 2.0)},
        {"backward": (2380.4, 300.0), "advantages": (1.0, 2.0)},
    )
    text = profile.verdict(result, {"naive": 2**30, "rlops": 2**29})
    assert "Largest time gain: advantages, 50.0 -> 1.000 ms." in text
    assert "Largest memory gain: backward, peak 900.0 -> 300.0 MiB." in text
    result = stage_results({"backward": (20.0, 900.0)}, {"backward": (10.0, 300.0)})
    text = profile.verdict(result, {"naive": 2**30, "rlops": 2**29})
    assert (
        "Largest time and memory gain: backward, 20.0 -> 10.0 ms, peak 900.0 -> 300.0 MiB." in text
    )


def test_profile_verdict_does_not_credit_the_forward_for_the_moved_lm_head():
    """With the fused-linear head the LM head runs in the log-prob stage: the forward alone
    looks 3x faster and the log-prob stage slower. Neither is a gain: the two count as one
    span, which here gained nothing, so advantages is the largest time gain."""
    result = stage_results(
        {"forward": (30.0, 100.0), "log-prob + entropy": (20.0, 300.0), "advantages": (50.0, 2)},
        {"forward": (10.0, 20.0), "log-prob + entropy": (45.0, 60.0), "advantages": (1.0, 2)},
    )
    for impl, (ms, mib) in (("naive", (50.0, 350.0)), ("rlops", (55.0, 70.0))):
        result[impl][profile.OUTPUT] = {"seconds": ms / 1e3, "peak_bytes": mib * 2**20}
    same = profile.same_code("fused-linear")
    text = profile.verdict(result, {"naive": 2**30, "rlops": 2**29}, same)
    assert "Largest time gain: advantages, 50.0 -> 1.000 ms." in text
    assert "Largest memory gain: forward + log-prob + entropy, peak 350.0 -> 70.0 MiB." in text
    assert "gain: forward," not in text
    rows = {r[0]: r for r in profile._rows(result, {"naive": 1, "rlops": 1}, same)}
    assert rows["forward"][5] == rows["log-prob + entropy"][5] == "head moved"
    assert rows[profile.OUTPUT][5] == "0.91x"
    # the materialised head runs the same forward: no span
    text = profile.verdict(result, {"naive": 2**30, "rlops": 2**29}, profile.same_code("logits"))
    assert "forward + log-prob" not in text


def test_profile_measures_the_forward_and_log_prob_span(tmp_path):
    """One timed step: the span's time is the forward's plus the log-prob stage's."""
    path = tmp_path / "p.json"
    tiny = "--batch 2 --seq-len 16 --vocab 32 --layers 1 --d-model 16 --heads 2 --repeats 1"
    assert main(["profile", *tiny.split(), "--device", "cpu", "--json", str(path)]) == 0
    for impl, stages in json.loads(path.read_text())["results"].items():
        span = stages[profile.OUTPUT]
        assert (
            span["seconds"]
            == stages["forward"]["seconds"] + stages["log-prob + entropy"]["seconds"]
        ), impl
        assert span["peak_bytes"] is not None
