"""``rlops bench`` beyond its options: timings at two thread counts (the thread count put back
after), the sanity warnings of a table, memory multiples, the verdict's wording, the progress
line (section names, time left) and output through the bar's console. Timings are injected:
nothing here depends on how fast anything runs."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from rlops.cli import bench, display, main, parser
from rlops.measure import sections, timing
from rlops.measure.sections import FLOOR, Row


def gae_rows(floor_ms: float, chunk_ms: dict[int, float], ours_ms: dict[int, float]) -> list:
    """One ``gae [8x32768]`` table with the given times (ms) per thread count."""

    def row(method, times, ours=False):
        times = {n: ms / 1e3 for n, ms in times.items()}
        seconds = times[max(times)] if ours else min(times.values())
        return Row("advantages", "gae", 32768, "8x32768", method, seconds, ours, times=times)

    return [
        row("chunk loop (C=256)", chunk_ms),
        row("rlops auto", ours_ms, ours=True),
        row(FLOOR, {1: floor_ms, 2: floor_ms}),
    ]


def test_a_floor_slower_than_what_it_bounds_is_a_warning():
    """The full bench at 8x32768 once timed the floor at 15.0 ms and rlops at 0.55 ms."""
    rows = gae_rows(15.0, {1: 5.0, 2: 6.0}, {1: 0.55, 2: 0.55})
    (text,) = bench.warnings(rows)
    assert text.startswith("the memory floor (15.0 ms) is slower than rlops auto (0.550 ms)")
    assert not bench.warnings(gae_rows(0.2, {1: 5.0, 2: 6.0}, {1: 0.55, 2: 0.55}))
    line = bench.verdicts(rows)[0]
    assert "x the memory floor" not in line and "floor measured slower than rlops" in line


def test_a_ratio_that_moves_over_2x_between_thread_counts_is_a_warning():
    """The chunk loop once took 1.24 ms at 1 thread and 94.1 ms at 2 (rlops 0.07 ms at both):
    1,344x against 18x. A move of 1.5x is not flagged."""
    rows = gae_rows(0.01, {1: 1.24, 2: 94.1}, {1: 0.07, 2: 0.07})
    (text,) = bench.warnings(rows)
    assert text.startswith("chunk loop (C=256) / rlops moves more than 2x between thread counts")
    assert "17.71 at 1 thread and 1,344.29 at 2 threads" in text
    assert rows[0].seconds == 1.24e-3  # the comparison rests on the faster count
    assert not bench.warnings(gae_rows(0.01, {1: 1.0, 2: 1.5}, {1: 0.07, 2: 0.07}))
    # the move may come from rlops' side too
    assert bench.warnings(gae_rows(0.01, {1: 1.0, 2: 1.0}, {1: 0.07, 2: 0.5}))


def test_warnings_are_printed_in_the_table_and_written_to_the_json(monkeypatch, tmp_path, capsys):
    rows = gae_rows(15.0, {1: 1.24, 2: 94.1}, {1: 0.55, 2: 0.55})
    monkeypatch.setattr(sections, "bench_advantages", lambda *a, **k: rows)
    path = tmp_path / "b.json"
    assert main(["bench", "--sections", "advantages", "--threads", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("gae [8x32768]") : out.index("Verdict:")]
    assert "warning: the memory floor (15.0 ms) is slower than" in table
    assert "warning: chunk loop (C=256) / rlops moves more than 2x" in table
    assert re.search(r"chunk loop \(C=256\)[\s│|]+1\.240[\s│|]+94\.1[\s│|]+2\.25", table)
    saved = json.loads(path.read_text())
    assert saved["thread_counts"] == [1, 2]
    assert len(saved["warnings"]) == 2
    assert all(w.startswith("gae [8x32768]: ") for w in saved["warnings"])
    assert saved["rows"][0]["times"] == {"1": 1.24 / 1e3, "2": 94.1 / 1e3}


def test_the_group_memory_multiple_is_over_the_group_batch(monkeypatch, capsys):
    """64 x 256 float32 values of extra memory are 1 [B, T] of the group section, whatever
    --batch (the advantages section's B) is."""
    unit = 64 * 256 * 4
    rows = [
        Row("group", "grpo", 256, "64x256", "per-sample loop", 1e-3, times={1: 1e-3}),
        Row("group", "grpo", 256, "64x256", "rlops", 1e-4, True, False, unit, {1: 1e-4}, unit),
    ]
    measured = sections.bench_group(16, 32, repeats=1, threads=1)
    assert {r.unit_bytes for r in measured} == {16 * 32 * 4}
    monkeypatch.setattr(sections, "bench_group", lambda *a, **k: rows)
    assert main(["bench", "--sections", "group", "--batch", "8", "--threads", "1"]) == 0
    assert "0.1 (1.00 x [B,T])" in capsys.readouterr().out


def test_verdict_says_slower_when_rlops_is_slower():
    rows = [
        Row("advantages", "gae", 64, "2x64", "chunk loop (C=256)", 0.7e-3),
        Row("advantages", "gae", 64, "2x64", "rlops auto", 1e-3, ours=True),
        Row("logprobs", "log-prob + entropy", 8, "8x16", "unfused", 1e-4),
        Row("logprobs", "log-prob + entropy", 8, "8x16", "rlops fused", 2e-4, True),
    ]
    gae, logprobs = bench.verdicts(rows)
    assert "chunk loop (C=256) 0.700 ms -> 1.000 ms (1.4x slower)" in gae
    assert "0.100 ms -> 0.200 ms (2.0x slower)" in logprobs
    assert "0.7x" not in gae + logprobs


def test_each_method_is_timed_at_each_thread_count_and_the_count_is_put_back():
    seen = []

    def fn():
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    times = timing.time_by_threads(fn, torch.device("cpu"), (1, 3), repeats=2, warmup=1)
    assert list(times) == [1, 3] and set(seen) == {1, 3}
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), timing.torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before


def test_thread_counts():
    assert sections.thread_counts("cpu", 4) == (1, 4)
    assert sections.thread_counts("cpu", 1) == (1,)
    assert sections.thread_counts("cpu") == sections.thread_counts("cpu", torch.get_num_threads())


def test_bench_threads_option_runs_at_that_count_and_puts_it_back(monkeypatch):
    seen = {}

    def group(*args, threads, **kwargs):
        seen["option"], seen["torch"] = threads, torch.get_num_threads()
        return []

    monkeypatch.setattr(sections, "bench_group", group)
    before = torch.get_num_threads()
    assert main(["bench", "--sections", "group", "--threads", "3"]) == 0
    assert seen == {"option": 3, "torch": 3}
    assert torch.get_num_threads() == before


def test_default_grid_is_smaller_than_full_and_full_is_a_flag(monkeypatch, tmp_path):
    assert max(bench.DEFAULTS["seq_len"]) < max(bench.FULL["seq_len"])
    assert bench.DEFAULTS["slow_limit_s"] < bench.FULL["slow_limit_s"]
    monkeypatch.setattr(sections, "bench_group", lambda *a, **k: [])
    for flags, preset in (([], bench.DEFAULTS), (["--full"], bench.FULL)):
        path = tmp_path / "b.json"
        assert main(["bench", "--sections", "group", *flags, "--json", str(path)]) == 0
        config = json.loads(path.read_text())["config"]
        assert {k: config[k] for k in preset} == preset
    with pytest.raises(SystemExit):
        main(["bench", "--quick", "--full"])


def test_progress_names_each_step_and_estimates_the_time_left(monkeypatch, capsys):
    """Off a terminal, a line per step: steps done, elapsed time, the time left (elapsed x
    weight left / weight done) and the step that runs now."""
    clock = iter([0.0, 0.0, 10.0, 40.0])
    monkeypatch.setattr(display.time, "perf_counter", lambda: next(clock))
    steps = [("advantages T=2048", 1.0), ("group", 1.0), ("logprobs N=1024", 2.0)]
    with display.Progress(steps, "rlops bench") as progress:
        progress.update()
        progress.update()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "rlops bench 0/3: advantages T=2048",
        "rlops bench 1/3 (0:10): ~0:30 left  group",
        "rlops bench 2/3 (0:40): ~0:40 left  logprobs N=1024",
    ]


def test_bench_plan_names_every_section():
    args = parser().parse_args(["bench", "--threads", "2"])
    for name, value in bench.DEFAULTS.items():
        setattr(args, name, getattr(args, name, None) or value)
    names = [name for name, _ in bench.plan(args)]
    assert names[: len(bench.DEFAULTS["seq_len"])] == [
        f"advantages T={t}" for t in bench.DEFAULTS["seq_len"]
    ]
    assert "group" in names and any(n.startswith("logprobs N=") for n in names)


def test_tables_print_through_the_bar_so_titles_stand_on_their_own_line(monkeypatch):
    """On a terminal, a table printed while the bar is shown goes above it: no line holds both
    the bar and the table's title."""
    rich_console = pytest.importorskip("rich.console")
    out = io.StringIO()
    monkeypatch.setattr(  # every console writes to one terminal, as consoles on stdout do
        display,
        "_new_console",
        lambda: rich_console.Console(file=out, force_terminal=True, width=100),
    )
    with display.Progress(2, "measuring") as progress:
        display.print_table("gae [2x64]", ["method", "ms"], [["x", "1.0"]])
        display.say("a line")
        progress.update()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())
    pieces = [p for p in re.split(r"[\r\n]", text) if p.strip()]
    titled = [p for p in pieces if "gae [2x64]" in p or "a line" in p]
    assert len(titled) == 2 and not any("measuring" in p for p in titled)
    assert display._live is None


def test_long_lines_wrap_between_words_only():
    line = (
        "- gae [8x131072]: per-token loop 4,401.4 ms -> 1.547 ms (2,845x faster); chunk loop "
        "(C=256) 15.7 ms -> 1.547 ms (10x faster). rlops runs at 2.9x the memory floor."
    )
    pieces = display.wrap(line, 40)
    assert len(pieces) > 2 and all(len(p) <= 40 for p in pieces)
    assert " ".join(p.strip() for p in pieces).split() == line.split()
    assert display.wrap(line) == [line]  # off a terminal (captured output): one line
