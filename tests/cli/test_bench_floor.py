"""The memory floor of ``rlops bench``'s advantages section: ``torch.add(r, v)`` and
``r.clone()``, the allocating floor, a row of both tables (GAE, REINFORCE++ returns) from one
timing, and the verdict's distance to it for both. Timings are injected."""

from __future__ import annotations

from rlops.cli import bench
from rlops.measure import sections
from rlops.measure.sections import FLOOR


def _fake(monkeypatch, calls: list) -> None:
    def interleaved(fns, device, counts, **kw):
        calls.append(list(fns))
        ms = {FLOOR: 0.25, "rlops auto": 0.5, "rlops chunked": 2.0}
        return {k: {n: ms.get(k[1], 4.0) * 1e-3 for n in counts} for k in fns}

    monkeypatch.setattr(sections, "time_interleaved", interleaved)
    monkeypatch.setattr(sections, "_peak", lambda fn, device, n: 2**19)
    monkeypatch.setattr(sections, "_baseline_call", lambda *a: ((lambda: None), 1, 0, 1.0))


def test_the_floor_is_a_row_of_both_tables_from_one_timing(monkeypatch):
    calls: list = []
    _fake(monkeypatch, calls)
    rows = sections.bench_advantages(2, [64, 128], repeats=1, threads=2)
    for t_len, timed in zip([64, 128], calls, strict=True):
        assert [k for k in timed if k[1] == FLOOR] == [("gae", FLOOR)]  # timed once
        floors = [r for r in rows if r.size == t_len and r.method == FLOOR]
        assert [r.case for r in floors] == ["gae", "reinforce++ returns"]
        assert floors[0].times == floors[1].times and floors[1].peak_bytes is None
        for case in ("gae", "reinforce++ returns"):
            table = [r.method for r in rows if r.size == t_len and r.case == case]
            assert table[-1] == FLOOR  # last, under rlops


def test_the_verdict_says_how_far_each_estimator_is_from_the_floor(monkeypatch):
    _fake(monkeypatch, [])
    lines = bench.verdicts(sections.bench_advantages(2, [64], repeats=1, threads=2))
    for case in ("gae", "reinforce++ returns"):
        (line,) = [x for x in lines if x.startswith(f"- {case} [2x64]")]
        assert line.endswith("rlops runs at 2.0x the memory floor.")
