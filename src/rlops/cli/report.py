"""Plain-word verdicts and plots for ``rlops bench`` rows."""

from __future__ import annotations

from collections import defaultdict

__all__ = ["plot_rows", "verdicts"]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 1000:
        return f"{ms / 1e3:,.2f} s"
    return f"{ms:,.2f} ms" if ms >= 0.1 else f"{ms:.3f} ms"


def _logprob_seconds_per_token(rows) -> float | None:
    """Fused log-prob + entropy time per token at the largest measured token count."""
    fused = [r for r in rows if r.section == "logprobs" and r.ours]
    if not fused:
        return None
    r = max(fused, key=lambda r: r.size)
    return r.seconds / r.size


def verdicts(rows, *, batch: int, vocab: int) -> list[str]:
    """One paragraph per case at its largest size: X -> Y (Z x), and whether it matters.

    "Whether it matters" compares with a fused log-prob + entropy pass over the same tokens
    (forward and backward, at ``vocab``), measured in this run: work every PPO step does anyway
    and a small part of it (the model's forward and backward are far larger).
    """
    out = ["", "Verdict:"]
    per_token = _logprob_seconds_per_token(rows)
    by_case = defaultdict(list)
    for r in rows:
        by_case[(r.section, r.case)].append(r)
    for (section, case), group in by_case.items():
        size = max(r.size for r in group)
        at = [r for r in group if r.size == size]
        ours = next(r for r in at if r.ours)
        shape = ours.shape
        if section == "logprobs":
            base = next(r for r in at if not r.ours)
            mem = ""
            if base.peak_bytes and ours.peak_bytes is not None:
                mem = (
                    f"; peak extra memory {base.peak_bytes / 2**20:,.0f} MiB -> "
                    f"{ours.peak_bytes / 2**20:,.0f} MiB ({ours.peak_bytes / base.peak_bytes:.2f}x)"
                )
            speed = base.seconds / ours.seconds
            how = f"{speed:.1f}x faster" if speed >= 1 else f"{1 / speed:.1f}x slower"
            out.append(
                f"- {case} [{shape}], forward + backward: {_ms(base.seconds)} -> "
                f"{_ms(ours.seconds)} ({how}){mem}."
            )
            continue
        parts = []
        for r in at:
            if r.ours or r.method.startswith("rlops") or r.method == "memory floor":
                continue
            est = " (extrapolated)" if r.extrapolated else ""
            parts.append(
                f"{r.method} {_ms(r.seconds)}{est} -> {_ms(ours.seconds)} "
                f"({r.seconds / ours.seconds:,.0f}x)"
            )
        line = f"- {case} [{shape}]: " + "; ".join(parts) + "."
        floor = next((r for r in at if r.method == "memory floor"), None)
        if floor is not None:
            line += f" rlops runs at {ours.seconds / floor.seconds:.1f}x the memory floor."
        if per_token is not None and section == "advantages":
            tokens = batch * size
            lp = per_token * tokens
            worst = max(
                (r for r in at if not r.method.startswith("rlops")), key=lambda r: r.seconds
            )
            share = worst.seconds / lp
            matters = "it matters" if share > 0.05 else "it is small either way"
            line += (
                f" For scale, a fused log-prob + entropy pass over the same {tokens:,} tokens "
                f"(V={vocab:,}) takes about {_ms(lp)} here: the {worst.method} costs "
                f"{share:.0%} of that ({matters}), rlops {ours.seconds / lp:.2%}."
            )
        out.append(line)
    return out


def plot_rows(rows, path: str) -> None:
    """Time vs size per method, log-log, one panel per section; hollow markers: extrapolated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r.section for r in rows))
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.5), squeeze=False)
    xlabel = {"advantages": "T (tokens per row)", "group": "T", "logprobs": "tokens"}
    for ax, section in zip(axes[0], sections):
        lines = defaultdict(list)
        for r in rows:
            if r.section == section:
                lines[f"{r.case}: {r.method}"].append(r)
        for label, pts in lines.items():
            pts.sort(key=lambda r: r.size)
            xs = [r.size for r in pts]
            ys = [r.seconds * 1e3 for r in pts]
            (line,) = ax.plot(xs, ys, marker="o", label=label, lw=2 if pts[0].ours else 1)
            for r in pts:
                if r.extrapolated:
                    ax.plot(
                        r.size, r.seconds * 1e3, marker="o", mfc="white", color=line.get_color()
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel.get(section, "size"))
        ax.set_ylabel("median time (ms)")
        ax.set_title(section)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
