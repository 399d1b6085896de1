"""The figure of an ``rlops bench`` run (``--plot``): one panel per section, for a page.

Sized for a documentation page's column (about 700 px wide): two panels to a row, large type,
short labels, each legend below its panel. Sections that compare several methods (advantages,
group) show median times; sections of two variants per case (logprobs, agentic) show rlops
over its baseline, time and peak memory, so that what a fused path costs and what it saves
stand side by side.
"""

from __future__ import annotations

import textwrap
from typing import Any

from rlops.measure.sections import Row

__all__ = ["PAIRS", "figure", "plot_rows"]

PAIRS = ("logprobs", "agentic", "distillation")  # drawn as rlops / its first baseline
_FAMILY = {"per-sample token loop": "per-token loop", "chunk loop (C=256)": "chunk loop"}
_SHORT = {
    "log-prob + entropy": "over logits",
    "output layer + log-prob + entropy": "output layer",
    "top-k forward KL from the output layer": "top-k KL",
    "top-k forward KL + tail from the output layer": "top-k KL + tail",
}


def plot_rows(rows: list[Row], path: str) -> None:
    """Write :func:`figure` of ``rows`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def figure(rows: list[Row]) -> Any:
    """One panel per section, two to a row, for a page's column (about 700 px wide): large
    type, short labels, each legend below its panel. Advantages and group: median time, lines
    against size (log-log; hollow markers: extrapolated) where a section has several sizes,
    bars where it has one. Log-probs and agentic: rlops over its baseline, time and peak
    memory, per case (log scale, 1 = the baseline): bars at one size, lines against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.section for r in rows))
    cols = min(2, len(names))
    nrows = -(-len(names) // cols)
    with plt.rc_context({"font.size": 12, "axes.titlesize": 13, "legend.fontsize": 11}):
        fig, axes = plt.subplots(
            nrows, cols, figsize=(4.8 * cols, 4.6 * nrows), squeeze=False, layout="constrained"
        )
        for ax, section in zip(axes.flat, names):
            mine = [r for r in rows if r.section == section]
            several = len({r.size for r in mine}) > 1
            if section in PAIRS:
                (_ratio_lines if several else _ratio_bars)(ax, mine)
            else:
                (_time_lines if several else _time_bars)(ax, mine)
            shape = "" if several else f" [{mine[-1].shape}]"
            ax.set_title(section + shape)
        for ax in axes.flat[len(names) :]:
            ax.remove()
    return fig


def _legend(ax, handles=None, ncol: int = 2) -> None:
    kw = {} if handles is None else {"handles": handles}
    ax.legend(**kw, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, frameon=False)


def _short(case: str) -> str:
    name = _SHORT.get(case, case.removeprefix("agentic: "))
    return textwrap.fill(name, 12, break_on_hyphens=False)


def _log_axis(ax, sizes) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)


def _time_lines(ax, rows: list[Row]) -> None:
    """Median time against size: a colour per method (token loops share one), a line style
    per case."""
    from matplotlib.lines import Line2D

    families = list(dict.fromkeys(_FAMILY.get(r.method, r.method) for r in rows))
    cases = list(dict.fromkeys(r.case for r in rows))
    colour = {f: f"C{i}" for i, f in enumerate(families)}
    dashes = dict(zip(cases, ("-", "--", ":", "-.")))
    for case in cases:
        for method in dict.fromkeys(r.method for r in rows if r.case == case):
            pts = sorted((r for r in rows if (r.case, r.method) == (case, method)), key=_size)
            c = colour[_FAMILY.get(method, method)]
            xs, ms = [r.size for r in pts], [r.seconds * 1e3 for r in pts]
            ax.plot(xs, ms, dashes[case], color=c, marker="o", lw=2.5 if pts[0].ours else 1.5)
            hollow = [(r.size, r.seconds * 1e3) for r in pts if r.extrapolated]
            if hollow:
                ax.plot(*zip(*hollow), ls="", marker="o", mfc="white", color=c)
    _log_axis(ax, sorted({r.size for r in rows}))
    ax.set_xlabel("T (tokens per row)" if rows[0].section == "advantages" else "size")
    ax.set_ylabel("median time (ms)")
    handles = [Line2D([], [], color=colour[f], marker="o", label=f) for f in families]
    handles += [Line2D([], [], color="k", ls=dashes[c], label=c) for c in cases]
    _legend(ax, handles)


def _size(r: Row) -> int:
    return r.size


def _time_bars(ax, rows: list[Row]) -> None:
    """Median time per case (bars, each labelled), a colour per method; log scale where the
    times span more than 20x."""
    cases = list(dict.fromkeys(r.case for r in rows))
    families = list(dict.fromkeys(_FAMILY.get(r.method, r.method) for r in rows))
    width = 0.8 / len(families)
    for j, family in enumerate(families):
        pts = [(i, r) for i, c in enumerate(cases) for r in rows
               if r.case == c and _FAMILY.get(r.method, r.method) == family]  # fmt: skip
        xs = [i + (j - (len(families) - 1) / 2) * width for i, _ in pts]
        bars = ax.bar(xs, [r.seconds * 1e3 for _, r in pts], width, label=family)
        ax.bar_label(bars, [_fmt_ms(r.seconds) for _, r in pts], fontsize=10)
    ms = [r.seconds * 1e3 for r in rows]
    if max(ms) > 20 * min(ms):
        ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), [_short(c) for c in cases])
    ax.margins(y=0.15)
    ax.set_ylabel("median time (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    _legend(ax)


def _ratios(rows: list[Row]) -> list[tuple[str, int, float, float | None]]:
    """``(case, size, time, memory)`` of rlops over its baseline, per case and size."""
    out = []
    for case in dict.fromkeys(r.case for r in rows):
        for size in sorted({r.size for r in rows if r.case == case}):
            at = [r for r in rows if (r.case, r.size) == (case, size)]
            ours = next(r for r in at if r.ours)
            base = next(r for r in at if not r.ours)
            mem = None
            if base.peak_bytes and ours.peak_bytes is not None:
                mem = ours.peak_bytes / base.peak_bytes
            out.append((case, size, ours.seconds / base.seconds, mem))
    return out


def _ratio_axis(ax, values: list[float]) -> None:
    ax.set_yscale("log")
    ax.set_ylim(min([*values, 1.0]) / 2.5, max([*values, 1.0]) * 2.5)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_ylabel("rlops / baseline (below 1: less)")
    ax.grid(True, axis="y", which="major", alpha=0.3)


def _ratio_bars(ax, rows: list[Row]) -> None:
    """Per case, rlops' time and peak memory over its baseline's, as bars from 1 (below 1:
    rlops takes less), each labelled."""
    ratios = _ratios(rows)
    times = [(i, r[2]) for i, r in enumerate(ratios)]
    memory = [(i, r[3]) for i, r in enumerate(ratios) if r[3] is not None]
    for j, (label, pts) in enumerate((("time", times), ("peak memory", memory))):
        xs = [i + (j - 0.5) * 0.4 for i, _ in pts]
        bars = ax.bar(xs, [v - 1 for _, v in pts], 0.4, bottom=1, label=label, color=f"C{j}")
        ax.bar_label(bars, [_times(v) for _, v in pts], fontsize=10)
    _ratio_axis(ax, [v for r in ratios for v in r[2:] if v is not None])
    ax.set_xticks(range(len(ratios)), [_short(r[0]) for r in ratios])
    _legend(ax)


def _ratio_lines(ax, rows: list[Row]) -> None:
    """Per case, rlops' time (solid) and peak memory (dashed) over its baseline's, against
    the token count."""
    from matplotlib.lines import Line2D

    ratios = _ratios(rows)
    cases = list(dict.fromkeys(r[0] for r in ratios))
    for i, case in enumerate(cases):
        pts = [r for r in ratios if r[0] == case]
        ax.plot([r[1] for r in pts], [r[2] for r in pts], "-", color=f"C{i}", marker="o")
        mem = [(r[1], r[3]) for r in pts if r[3] is not None]
        if mem:
            ax.plot(*zip(*mem), "--", color=f"C{i}", marker="s")
    _log_axis(ax, sorted({r[1] for r in ratios}))
    _ratio_axis(ax, [v for r in ratios for v in r[2:] if v is not None])
    ax.set_xlabel("tokens N")
    handles = [Line2D([], [], color=f"C{i}", label=_short(c).replace("\n", " "))
               for i, c in enumerate(cases)]  # fmt: skip
    handles += [Line2D([], [], color="k", ls="-", label="time"),
                Line2D([], [], color="k", ls="--", label="peak memory")]  # fmt: skip
    _legend(ax, handles)


def _fmt_ms(seconds: float) -> str:
    """Milliseconds as the tables print them: three decimals below 10 ms, one above."""
    ms = seconds * 1e3
    return f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"


def _times(x: float) -> str:
    """A ratio as a bar's label: ``0.043x``, ``0.33x``, ``1.40x``, ``12x``."""
    return f"{x:.0f}x" if x >= 10 else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"
