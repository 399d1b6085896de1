"""``rlops bench`` beyond its options: methods timed interleaved (the order of the calls, on a
fake clock), each compared at its own faster thread count (the thread count put back after),
the sanity warnings of a table, memory multiples, the verdict's wording on synthetic numbers,
the tables and plot of a default-grid run (measurements faked) against what the docs say, the
progress line (section names, time left) and output through the bar's console. Timings are
injected: nothing here depends on how fast anything runs."""

from __future__ import annotations

import io
import json
import pathlib
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
        return sections._row("advantages", "gae", 32768, "8x32768", method, times, ours)

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
    cells = r"[\s│|]+"
    assert re.search(
        cells.join([r"chunk loop \(C=256\)", r"1\.240", r"94\.1", "1 thread", r"2\.25"]), table
    )
    saved = json.loads(path.read_text())
    assert saved["thread_counts"] == [1, 2]
    assert len(saved["warnings"]) == 2
    assert all(w.startswith("gae [8x32768]: ") for w in saved["warnings"])
    assert saved["rows"][0]["times"] == {"1": 1.24 / 1e3, "2": 94.1 / 1e3}
    assert saved["rows"][0]["threads"] == 1 and saved["verdict"] == bench.verdicts(rows)


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


class FakeClock:
    """A clock that only moves when a timed function says so: each call of ``work(name,
    seconds_by_threads)`` records ``(name, torch threads)`` and advances the clock."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def __call__(self) -> float:
        return self.now

    def work(self, name: str, seconds: dict[int, float]):
        def fn():
            n = torch.get_num_threads()
            self.calls.append((name, n))
            self.now += seconds[n]

        return fn


def test_methods_are_timed_interleaved_within_each_repeat():
    """Warm-up at the largest count; then every repeat times each method once per count, odd
    repeats in reverse order (A B, B A); medians per method and count; the count put back."""
    clock = FakeClock()
    fns = {"a": clock.work("a", {1: 3.0, 2: 2.0}), "b": clock.work("b", {1: 1.0, 2: 5.0})}
    before = torch.get_num_threads()
    times = timing.time_interleaved(fns, torch.device("cpu"), (1, 2), repeats=3, clock=clock)
    assert torch.get_num_threads() == before
    assert times == {"a": {1: 3.0, 2: 2.0}, "b": {1: 1.0, 2: 5.0}}
    forward = [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert clock.calls == [("a", 2), ("b", 2), *forward, *forward[::-1], *forward]


def test_a_slow_method_takes_part_in_the_first_repeats_only():
    clock = FakeClock()
    fns = {"fast": clock.work("fast", {1: 1.0}), "slow": clock.work("slow", {1: 9.0})}
    times = timing.time_interleaved(
        fns, torch.device("cpu"), (1,), repeats={"fast": 3, "slow": 1},
        warmup={"fast": 1, "slow": 0}, clock=clock,
    )  # fmt: skip
    assert times == {"fast": {1: 1.0}, "slow": {1: 9.0}}
    assert clock.calls == [("fast", 1), ("fast", 1), ("slow", 1), ("fast", 1), ("fast", 1)]


def test_a_fast_method_repeats_until_its_budget():
    """With a budget, a method of 1/64 s repeats ten times in 10/64 s of calls (its median
    then rests on many calls); one of 1 s keeps its two repeats. (Binary fractions: exact.)"""
    clock = FakeClock()
    fns = {"fast": clock.work("fast", {1: 1 / 64}), "slow": clock.work("slow", {1: 1.0})}
    times = timing.time_interleaved(
        fns, torch.device("cpu"), (1,), repeats=2, warmup=0, budget_s=10 / 64, clock=clock
    )
    assert times == {"fast": {1: 1 / 64}, "slow": {1: 1.0}}
    assert clock.calls == [("fast", 1), ("slow", 1), ("slow", 1), *[("fast", 1)] * 9]
    # the budget is split over the counts, each spent at its own pace: a count where the
    # function stalls keeps its repeats, and does not take the others' calls away
    clock = FakeClock()
    fns = {"f": clock.work("f", {1: 1 / 64, 2: 1.0})}
    timing.time_interleaved(
        fns, torch.device("cpu"), (1, 2), repeats=2, warmup=0, budget_s=20 / 64, clock=clock
    )
    assert clock.calls.count(("f", 1)) == 10 and clock.calls.count(("f", 2)) == 2


def test_group_section_times_its_methods_interleaved(monkeypatch):
    """bench_group hands every method of both cases to one interleaved timing."""
    seen = []

    def fake(fns, device, counts, **kw):
        seen.append(list(fns))
        return {key: {n: 1e-3 for n in counts} for key in fns}

    monkeypatch.setattr(sections, "time_interleaved", fake)
    rows = sections.bench_group(16, 32, repeats=1, threads=2)
    assert seen == [[("grpo", "per-sample loop"), ("grpo", "rlops"),
                     ("rloo", "per-sample loop"), ("rloo", "rlops")]]  # fmt: skip
    assert [(r.case, r.method, r.threads) for r in rows][:2] == [
        ("grpo", "per-sample loop", 1), ("grpo", "rlops", 1)]  # fmt: skip


def issue_rows() -> list[Row]:
    """The tracker's numbers: the baseline fastest at 2 threads (121.9 ms), rlops at 1
    (108.1 ms; 137.9 ms at 2)."""
    times = ({1: 150.0e-3, 2: 121.9e-3}, {1: 108.1e-3, 2: 137.9e-3})
    return [
        sections._row("logprobs", "log-prob + entropy", 512, "512x32000", method, t, ours,
                      peak_bytes=peak)
        for method, t, ours, peak in (("unfused (log_softmax)", times[0], False, 400 * 2**20),
                                      ("rlops fused", times[1], True, 80 * 2**20))
    ]  # fmt: skip


def test_each_method_is_compared_at_its_own_fastest_thread_count(capsys):
    """Not the baseline's best against rlops at the run's count: that read 1.1x slower."""
    rows = issue_rows()
    assert [(r.seconds, r.threads) for r in rows] == [(121.9e-3, 2), (108.1e-3, 1)]
    (line,) = bench.verdicts(rows)
    assert "121.9 ms at 2 threads -> 108.1 ms at 1 thread (about as fast: 1.13x faster)" in line
    bench.print_rows(rows, (1, 2))
    out = capsys.readouterr().out
    assert "fastest at" in out
    cells = r"[\s│|]+"
    assert re.search(cells.join(["unfused \\(log_softmax\\)", "150.0", "121.9", "2 threads"]), out)
    assert re.search(cells.join(["rlops fused", "108.1", "137.9", "1 thread", "1.00"]), out)


# (rlops' time over the baseline's, its peak memory over the baseline's) -> the judgement
JUDGED = [
    ((1.39, 0.33), "trades time for memory"),  # the fused linear op at 2048 x 32000
    ((2.4, 0.87), "does not pay off"),  # the fused linear op at 512 x 32000, busy machine
    ((1.3, 0.6), "does not pay off"),  # a saving under half the peak is not worth the time
    ((0.5, 0.2), "pays off in time and in memory"),
    ((0.5, 1.0), "pays off in time."),
    ((0.5, 1.5), "pays off in time, at more memory"),
    ((1.1, 0.3), "pays off in memory, at no cost in time"),  # within 15%: as fast
    ((0.95, 1.0), "does not pay off"),
    ((1.5, 1.0), "does not pay off"),
    ((1.5, None), "does not pay off at this shape."),
    ((0.2, None), "pays off in time."),
]


@pytest.mark.parametrize(("ratios", "words"), JUDGED)
def test_the_verdict_says_where_rlops_pays_off(ratios, words):
    text = bench.pays_off(*ratios)
    assert words in text
    judgements = ("trades time", "pays off in", "does not pay off")
    assert sum(j in text for j in judgements) == 1  # one judgement, never two
    if "trades" in words or (words.startswith("does not") and ratios[1] is not None):
        assert "the saving grows with N x V" in text  # where it would pay off


def test_the_output_layer_verdict_names_the_trade():
    """2.4x slower and 0.87x the memory was one busy run at 512 x 32000; at 2048 x 32000 the
    op costs ~1.4x the time for a third of the memory: the line says what that buys."""
    rows = [
        sections._row("logprobs", "output layer + log-prob + entropy", 2048,
                      "2048x32000, H=256", method, {1: t * 1.2, 2: t}, ours, peak_bytes=peak)
        for method, t, ours, peak in (
            ("materialised logits + rlops fused", 1.0, False, 584 * 2**20),
            ("rlops fused linear", 1.39, True, 195 * 2**20))
    ]  # fmt: skip
    (line,) = bench.verdicts(rows)
    assert "1,000.0 ms at 2 threads -> 1,390.0 ms at 2 threads (1.4x slower)" in line
    assert "peak extra memory 584.0 MiB -> 195.0 MiB (0.33x)" in line
    assert "trades time for memory: it pays off where memory binds" in line


def test_times_within_fifteen_percent_read_about_as_fast():
    """A band, so that a busy machine's noise between two close methods does not flip the
    word; the ratio is still printed."""
    base = Row("logprobs", "c", 8, "8x16", "base", 1.00, times={1: 1.00})
    for ours_s, words in ((1.1, "about as fast: 1.10x slower"),
                          (0.9, "about as fast: 1.11x faster"),
                          (1.2, "1.2x slower"), (0.8, "1.2x faster")):  # fmt: skip
        ours = Row("logprobs", "c", 8, "8x16", "rlops", ours_s, True, times={1: ours_s})
        assert words in bench.verdicts([base, ours])[0]


def fake_measurements(monkeypatch) -> None:
    """Every section's measurements faked (nothing timed, no process spawned): each method
    1 ms at 1 thread and 2 ms at more, rlops 0.5 ms at each; 1 MiB of peak, rlops 0.5."""

    def times(key, counts):
        ours = "rlops" in str(key) or "CSR" in str(key)
        return {n: (0.5 if ours else 1.0 if n == 1 else 2.0) * 1e-3 for n in counts}

    def interleaved(fns, device, counts, **kw):
        return {key: times(key, counts) for key in fns}

    def case(variants, device, repeats, counts):
        label = list(variants)
        return ({k: times(k, counts) for k in label},
                {k: 2**19 if k == label[1] else 2**20 for k in label})  # fmt: skip

    monkeypatch.setattr(sections, "time_interleaved", interleaved)
    monkeypatch.setattr(sections, "_measure_case", case)
    monkeypatch.setattr(sections, "_peak", lambda fn, device, n: 2**19)
    monkeypatch.setattr(sections, "_baseline_call", lambda *a: ((lambda: None), 1, 0, 1.0))


def test_the_docs_count_the_tables_and_quote_the_verdict_of_the_default_grid(
    monkeypatch, tmp_path, capsys
):
    """docs/cli.md says how many tables the default grid prints; it and the README's
    "Measured" section quote verdict lines of the shapes that grid runs."""
    fake_measurements(monkeypatch)
    path = tmp_path / "b.json"
    assert main(["bench", "--threads", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    rows = [Row(**{**r, "times": {int(n): t for n, t in r["times"].items()}})
            for r in saved["rows"]]  # fmt: skip
    printed = bench.tables(rows)
    assert all(title in out for title in printed)
    assert f"{len(printed)} tables" in out
    root = pathlib.Path(__file__).resolve().parents[2]
    cli = (root / "docs" / "cli.md").read_text()
    (count,) = re.findall(r"of its (\d+) tables", cli)
    assert int(count) == len(printed)
    prefixes = {line.split("]")[0] + "]" for line in saved["verdict"]}
    readme = (root / "README.md").read_text()
    measured = readme[readme.index("## Measured") :]
    measured = measured[: measured.index("\n## ", 1)]
    sample = cli[cli.index("What the default grid printed") :]
    sample = sample[: sample.index("```", sample.index("```") + 3)]
    for text in (sample, measured):  # the verdict lines each quotes
        quoted = {m.split("]")[0] + "]" for m in re.findall(r"^- [^\n]*\]", text, re.M)}
        assert quoted and quoted <= prefixes, quoted - prefixes


def test_the_plot_draws_every_section_in_type_a_page_column_can_show(monkeypatch):
    """A panel per section (at one size: bars; at several: lines), no panel left empty,
    a figure under 10 in wide (a 700 px column shrinks it less than 0.7x) and no text under
    10 pt."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from rlops.measure import plot

    fake_measurements(monkeypatch)
    one = sections.bench_advantages(2, [64], repeats=1, threads=2)
    several = sections.bench_advantages(2, [64, 128], repeats=1, threads=2)
    group = sections.bench_group(16, 32, repeats=1, threads=2)
    for tokens in ([64], [64, 128]):
        logprobs = sections.bench_logprobs(tokens, 256, hidden=8, threads=2)
        agentic = sections.bench_agentic(tokens, 256, hidden=8, threads=2)
        for advantages in (one, several):
            fig = plot.figure(advantages + group + logprobs + agentic)
            titles = [ax.get_title().split(" ")[0] for ax in fig.axes]
            assert titles == ["advantages", "group", "logprobs", "agentic"]
            assert all(ax.has_data() for ax in fig.axes)
            assert fig.get_figwidth() <= 10
            texts = [t for t in fig.findobj(Text) if t.get_text().strip()]
            assert min(t.get_fontsize() for t in texts) >= 10
            plt.close(fig)
    fig = plot.figure(group)
    assert len(fig.axes) == 1


def test_the_docs_grid_is_the_presets():
    cli = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for label, preset in (("default", bench.DEFAULTS), ("`--quick`", bench.QUICK),
                          ("`--full`", bench.FULL)):  # fmt: skip
        (line,) = [x for x in cli.splitlines() if x.startswith(f"| {label} |")]
        cells = [c.strip() for c in line.strip("|").split("|")[1:]]

        def text(v):
            return " ".join(map(str, v)) if isinstance(v, list) else str(v)

        assert cells == [
            text(preset["seq_len"]), text(preset["logprob_tokens"]),
            f"{preset['vocab']}, {preset['hidden']}", text(preset["group_batch"]),
            text(preset["repeats"]),
        ]  # fmt: skip
