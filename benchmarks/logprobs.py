"""Fused log-probs + entropy vs the unfused reference, and the fused output layer vs logits.

    python benchmarks/logprobs.py            # the figures: T=4096, V=32000; N=8192, V=32000, H=512
    python benchmarks/logprobs.py --quick    # small shapes, a few seconds

Every variant runs forward + backward with random upstream gradients for both outputs
(log-prob and entropy), in float32 on CPU, each in its own fresh process (see ``_measure``).
Ratios are fused / baseline, measured side by side in one run: below 1 is better.
"""

from __future__ import annotations

import argparse
from typing import Any

from rlops.cli.measure import METHOD, measure_in_fresh_process
from rlops.cli.workloads import setup_linear, setup_logits

FULL = {"t": 4096, "v": 32000, "n": 8192, "h": 512}
QUICK = {"t": 1024, "v": 8000, "n": 2048, "h": 128}


def run(quick: bool = False, threads: int = 1) -> dict[str, Any]:
    """Measure the four variants; returns shapes, per-variant figures and the ratios."""
    s = QUICK if quick else FULL
    reps = {"repeats": 3, "warmup": 1, "threads": threads}
    lin_reps = {"repeats": 2, "warmup": 1, "threads": threads}
    m = {}
    for name, fused in (("unfused", False), ("fused", True)):
        m[name] = measure_in_fresh_process(
            setup_logits, {"t": s["t"], "v": s["v"], "fused": fused},
            prime_kwargs={"t": 8, "v": 64, "fused": fused}, **reps)
    for name, fused in (("materialised + fused", False), ("fused linear", True)):
        m[name] = measure_in_fresh_process(
            setup_linear, {"n": s["n"], "v": s["v"], "h": s["h"], "fused": fused},
            prime_kwargs={"n": 8, "v": 64, "h": 8, "fused": fused}, **lin_reps)

    def ratio(a: str, b: str, key: str) -> float:
        return m[a][key] / m[b][key]

    return {
        "shapes": s,
        "threads": threads,
        "method": METHOD,
        "variants": m,
        "ratios": {
            "fused/unfused time": ratio("fused", "unfused", "time_s"),
            "fused/unfused peak extra memory": ratio("fused", "unfused", "peak_extra_bytes"),
            "fused linear/materialised time": ratio("fused linear", "materialised + fused",
                                                    "time_s"),
            "fused linear/materialised peak extra memory": ratio(
                "fused linear", "materialised + fused", "peak_extra_bytes"),
        },
    }


def report(res: dict[str, Any]) -> str:
    s = res["shapes"]
    lines = [
        f"log-probs + entropy, forward + backward, float32, CPU, torch threads={res['threads']}",
        f"  logits: T={s['t']}, V={s['v']};  linear: N={s['n']}, V={s['v']}, H={s['h']}",
        f"  {res['method']}",
        "",
        f"  {'variant':<22}{'time (median)':>16}{'peak extra memory':>20}",
    ]
    for name, r in res["variants"].items():
        lines.append(f"  {name:<22}{r['time_s'] * 1e3:>13.1f} ms"
                     f"{r['peak_extra_bytes'] / 2**20:>16.1f} MiB")
    lines.append("")
    lines += [f"  {k:<46}{v:6.3f}" for k, v in res["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per variant")
    args = parser.parse_args(argv)
    print(report(run(quick=args.quick, threads=args.threads)))


if __name__ == "__main__":
    main()
