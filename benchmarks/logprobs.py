"""Fused log-probs + entropy vs the unfused reference, and the fused output layer vs logits.

    python benchmarks/logprobs.py --contention 2 --json logprobs.json   # the full grid
    python benchmarks/logprobs.py --quick                              # small shapes, 1-2 min
    python benchmarks/logprobs.py --sections linear top-p --linear 2048x151936 --hidden 2048 \
        --dtype bfloat16                                               # one case of the grid

Every variant runs forward + backward with random upstream gradients for both outputs (log-prob
and entropy), on CPU, each in its own fresh process (time: median wall time after a warm-up
call; memory: the peak resident set above the one once the inputs exist).

* linear cases, N x V tokens x vocabulary at hidden size H and a dtype (by default N x V =
  8192 x 32000 and 2048 x 151936, H = 512 and 2048, float32 and bfloat16), at the largest
  ``--threads``:

  - ``materialised + fused``: ``logits = hidden @ weight.T``, then ``logprobs_and_entropy``;
  - ``fused linear``: ``linear_logprobs_and_entropy`` (the logits never exist whole);
  - ``materialised + keep mask`` (section ``top-p``): the logits and a full ``[N, V]`` bool
    keep mask of the top-p support built as trainers do (sort, cumsum, scatter), then
    ``logprobs_and_entropy(keep_mask=...)``;
  - ``fused linear top-p`` (section ``top-p``): ``linear_logprobs_and_entropy(top_p=...)``.

* logits cases, T x V float32 logits (by default 2048 x 32000 and 4096 x 32000), at each
  ``--threads``: ``log_softmax + gather + entropy`` (unfused) vs ``fused logits``
  (``logprobs_and_entropy``); with ``--contention N``, both again while N busy processes (one
  thread each, spinning a small matmul loop) run, started before and killed after each
  measurement, so each variant's slow-down under contention is measured side by side.

* agentic cases (``--agentic``, alone): N x V x H (by default 8192 x 32000 x 512, float32), with
  a row ``mask`` of ``--valid`` (3%) of the rows, each variant against the same call without
  it: the linear op forward + backward and the logits op forward (``masked / unmasked``); then
  the kept sets of ``--ids`` (20 and 512) random ids per row given to the linear op (forward +
  backward) as CSR (``support_ids``, ``support_offsets``), as the dense ``[N, V]`` bool
  ``keep_mask`` and not at all (``csr / none`` and ``dense / none``, time and peak memory).

Ratios are fused / baseline (and contended / quiet), computed from the measurements of this
run: below 1, the fused variant takes less. The full grid has not been timed here; expect hours
on 2 CPU cores (an H = 2048 case does about 1 TFLOP per output-layer matmul, a few per step,
and CPU bfloat16 matmuls can be slower than float32) and several GiB per process (the keep
mask path holds the logits, a sort's values and int64 indices and two more float32 ``[N, V]``
tensors: about 5 GiB at 8192 x 32000 float32); ``--sections`` and the shape options pick a
subset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rlops.measure.options import positive_int, top_p, writable_path
from rlops.measure.timing import METHOD, measure_in_fresh_process
from rlops.measure.workloads import setup_linear, setup_logits

SECTIONS = ("linear", "top-p", "logits")
FULL = {
    "linear": [(8192, 32000), (2048, 151936)],
    "hidden": [512, 2048],
    "dtype": ["float32", "bfloat16"],
    "logits": [(2048, 32000), (4096, 32000)],
    "threads": [1, 2],
}
QUICK = {
    "linear": [(2048, 8000)],
    "hidden": [64],
    "dtype": ["float32"],
    "logits": [(1024, 8000)],
    "threads": [1, 2],
}
UNFUSED, FUSED = "log_softmax + gather + entropy", "fused logits"
# name: (section, fused, with top-p)
LINEAR_VARIANTS = {
    "materialised + fused": ("linear", False, False),
    "fused linear": ("linear", True, False),
    "materialised + keep mask": ("top-p", False, True),
    "fused linear top-p": ("top-p", True, True),
}
SPIN = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(256, 256)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    a @ a\n"
)


@contextlib.contextmanager
def contention(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy processes (one thread each, a 256 x 256 matmul loop), all spinning before
    the block starts; killed when it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN], stdout=subprocess.PIPE, env=env, text=True
                )
            )
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"contention process {p.pid} did not start")
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            p.stdout.close()


def _measure(setup, kwargs: dict, prime: dict, threads: int, repeats: int, load: int = 0):
    with contention(load):
        return measure_in_fresh_process(
            setup, kwargs, prime_kwargs=prime, threads=threads, repeats=repeats, warmup=1
        )


def _ratio(variants: dict, a: str, b: str, key: str) -> float | None:
    """``a / b`` for one measured quantity; None where ``b`` measured 0 (tiny shapes)."""
    den = variants[b][key]
    return variants[a][key] / den if den else None


def linear_case(
    n: int, v: int, h: int, dtype: str, threads: int, p: float, sections=SECTIONS
) -> dict[str, Any]:
    """The output-layer variants of ``sections`` at ``[n, h] @ [v, h].T``, and their ratios."""
    variants = {}
    for name, (section, fused, sampled) in LINEAR_VARIANTS.items():
        if section in sections:
            kw = {"fused": fused, "dtype": dtype, "top_p": p if sampled else None}
            variants[name] = _measure(
                setup_linear, {"n": n, "v": v, "h": h, **kw}, {"n": 8, "v": 64, "h": 8, **kw},
                threads, repeats=2,
            )  # fmt: skip
    ratios = {}
    for section, ours, base in (
        ("linear", "fused linear", "materialised + fused"),
        ("top-p", "fused linear top-p", "materialised + keep mask"),
    ):
        if section in sections:
            for key, what in (("time_s", "time"), ("peak_extra_bytes", "peak extra memory")):
                ratios[f"{ours} / {base}, {what}"] = _ratio(variants, ours, base, key)
    title = f"linear N={n} V={v} H={h} {dtype}" + (f", top_p={p}" if "top-p" in sections else "")
    return {
        "kind": "linear",
        "title": f"{title}, torch threads={threads}",
        "shape": {"n": n, "v": v, "h": h, "dtype": dtype, "top_p": p},
        "threads": threads,
        "variants": variants,
        "ratios": ratios,
    }


def logits_case(t: int, v: int, threads: int, load: int = 0) -> dict[str, Any]:
    """Unfused and fused log-probs + entropy over ``[t, v]`` float32 logits at ``threads``;
    with ``load`` > 0 both again under that many busy processes."""
    variants = {}
    loads = (0, load) if load else (0,)
    for n_busy in loads:
        for name, fused in ((UNFUSED, False), (FUSED, True)):
            label = name + (f", contention {n_busy}" if n_busy else "")
            variants[label] = _measure(
                setup_logits, {"t": t, "v": v, "fused": fused}, {"t": 8, "v": 64, "fused": fused},
                threads, repeats=3, load=n_busy,
            )  # fmt: skip
    ratios = {
        f"{FUSED} / unfused, time": _ratio(variants, FUSED, UNFUSED, "time_s"),
        f"{FUSED} / unfused, peak extra memory": _ratio(
            variants, FUSED, UNFUSED, "peak_extra_bytes"
        ),
    }
    if load:
        c = f", contention {load}"
        ratios[f"{FUSED} / unfused, time{c}"] = _ratio(variants, FUSED + c, UNFUSED + c, "time_s")
        ratios[f"unfused, time{c} / quiet"] = _ratio(variants, UNFUSED + c, UNFUSED, "time_s")
        ratios[f"{FUSED}, time{c} / quiet"] = _ratio(variants, FUSED + c, FUSED, "time_s")
    return {
        "kind": "logits",
        "title": f"logits T={t} V={v} float32, torch threads={threads}",
        "shape": {"t": t, "v": v},
        "threads": threads,
        "contention": load,
        "variants": variants,
        "ratios": ratios,
    }


def run(
    *,
    linear: list[tuple[int, int]] = FULL["linear"],
    hidden: list[int] = FULL["hidden"],
    dtype: list[str] = FULL["dtype"],
    logits: list[tuple[int, int]] = FULL["logits"],
    threads: list[int] = FULL["threads"],
    contention: int = 0,
    top_p: float = 0.9,
    sections=SECTIONS,
    on_case: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Measure every case; ``on_case(case)`` as each completes. Returns the configuration,
    the method and the cases (each with its variants' measurements and its ratios)."""
    config = {
        "linear": [list(s) for s in linear],
        "hidden": list(hidden),
        "dtype": list(dtype),
        "logits": [list(s) for s in logits],
        "threads": list(threads),
        "contention": contention,
        "top_p": top_p,
        "sections": [s for s in SECTIONS if s in sections],
    }
    cases = []

    def done(case: dict) -> None:
        cases.append(case)
        if on_case is not None:
            on_case(case)

    if "linear" in sections or "top-p" in sections:
        for n, v in linear:
            for h in hidden:
                for dt in dtype:
                    done(linear_case(n, v, h, dt, max(threads), top_p, sections))
    if "logits" in sections:
        for t, v in logits:
            for k in threads:
                done(logits_case(t, v, k, contention))
    return {"method": METHOD, "config": config, "cases": cases}


def _fmt(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.3f}"


def case_report(case: dict) -> str:
    """A case's table (median time, peak extra memory per variant) and its ratios."""
    width = max(len(k) for k in case["variants"]) + 2
    lines = [case["title"], f"  {'variant':<{width}}{'time (median)':>16}{'peak extra':>14}"]
    for name, r in case["variants"].items():
        lines.append(
            f"  {name:<{width}}{r['time_s'] * 1e3:>13.1f} ms{r['peak_extra_bytes'] / 2**20:>10.1f}"
            " MiB"
        )
    width = max(len(k) for k in case["ratios"]) + 2
    lines += [f"  {k:<{width}}{_fmt(v)}" for k, v in case["ratios"].items()]
    return "\n".join(lines)


def report(res: dict[str, Any]) -> str:
    """Every case's table and ratios, after a header with the method."""
    head = [
        "log-probs + entropy, forward + backward with random upstream gradients, CPU",
        f"  {res['method']}",
        "  ratios: fused / baseline (contended / quiet), from this run; below 1 = takes less",
    ]
    return "\n\n".join(["\n".join(head), *(case_report(c) for c in res["cases"])])


def summary(res: dict[str, Any]) -> str:
    """Every ratio of the run, one line each, under its case's title."""
    lines = ["ratios (fused / baseline, contended / quiet; below 1 = takes less)"]
    for case in res["cases"]:
        lines.append(f"  {case['title']}")
        lines += [f"    {k:<64}{_fmt(v)}" for k, v in case["ratios"].items()]
    return "\n".join(lines)


def shape(text: str) -> tuple[int, int]:
    """``AxB`` -> ``(A, B)``, both positive integers."""
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AxB (e.g. 8192x32000), got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return a, b


def non_negative_int(text: str) -> int:
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")


def _sizes(name: str) -> str:
    def text(vs) -> str:
        return " ".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in vs)

    return f"(default {text(FULL[name])}; --quick: {text(QUICK[name])})"


# --------------------------------------------------------------------------- agentic shapes
def _agentic_inputs(n: int, v: int, h: int, valid: float):
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    # in place: a temporary of the weight's size would raise the high-water the peak is
    # measured above
    weight = torch.randn(v, h, generator=gen).div_(h**0.5).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) < valid
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return torch, gen, hidden, weight, target, mask, grads


def setup_agentic_linear(n: int, v: int, h: int, valid: float, masked: bool) -> Callable:
    """The linear op forward + backward, with or without the row mask (``rlops bench``'s
    workload, :func:`rlops.measure.workloads.setup_agentic`)."""
    from rlops.measure.workloads import setup_agentic

    return setup_agentic(n, v, h, "mask" if masked else "all", valid=valid)


def setup_agentic_logits(n: int, v: int, h: int, valid: float, masked: bool) -> Callable:
    """The logits op forward (no gradient), with or without the row mask."""
    torch, gen, _, _, target, mask, _ = _agentic_inputs(n, v, 1, valid)
    from rlops.logprobs import logprobs_and_entropy

    logits = torch.randn(n, v, generator=gen)
    kw = {"mask": mask} if masked else {}

    def step() -> None:
        with torch.no_grad():
            logprobs_and_entropy(logits, target, **kw)

    return step


def setup_agentic_support(n: int, v: int, h: int, ids: int, form: str) -> Callable:
    """The linear op forward + backward with ``ids`` kept ids per row given as CSR, as the
    dense keep mask (built inside the step, as a trainer does from the engine's sets), or no
    support (``form``: ``"csr"``, ``"dense"``, ``"none"``): ``rlops bench``'s workload."""
    from rlops.measure.workloads import setup_agentic

    return setup_agentic(n, v, h, "all" if form == "none" else form, ids=ids)


def agentic(
    n: int,
    v: int,
    h: int,
    valid: float,
    ids: list[int],
    repeats: int,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """The agentic cases: ``[{case, variant: measurement, ratios}]``; ``on_row(row)`` as each
    case completes."""
    tiny = {"n": 64, "v": 512, "h": 16}
    rows = []
    for name, setup in (("linear fwd+bwd", setup_agentic_linear),
                        ("logits fwd", setup_agentic_logits)):  # fmt: skip
        got = {
            tag: measure_in_fresh_process(
                setup,
                {"n": n, "v": v, "h": h, "valid": valid, "masked": masked},
                prime_kwargs={**tiny, "valid": valid, "masked": masked},
                repeats=repeats,
            )
            for tag, masked in (("unmasked", False), ("masked", True))
        }
        rows.append({"case": f"{name}, {valid:.0%} valid rows", **got})
        if on_row is not None:
            on_row(rows[-1])
    for k in ids:
        got = {
            form: measure_in_fresh_process(
                setup_agentic_support,
                {"n": n, "v": v, "h": h, "ids": k, "form": form},
                prime_kwargs={**tiny, "ids": min(k, 8), "form": form},
                repeats=repeats,
            )
            for form in ("none", "csr", "dense")
        }
        rows.append({"case": f"linear fwd+bwd, {k} ids/row", **got})
        if on_row is not None:
            on_row(rows[-1])
    return rows


_HEADER = (
    "| case | variant | time (s) | peak memory (MiB) | time / baseline | memory / baseline |\n"
    "|---|---|---|---|---|---|"
)


def agentic_report(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        base = row.get("unmasked") or row.get("none")
        for tag in ("unmasked", "masked", "none", "csr", "dense"):
            if tag not in row:
                continue
            m = row[tag]
            mem, bmem = m["peak_extra_bytes"] / 2**20, base["peak_extra_bytes"] / 2**20
            mem_ratio = (mem / bmem) if mem is not None and bmem else None
            lines.append(
                f"| {row['case']} | {tag} | {m['time_s']:.3f} | {_fmt(mem)} | "
                f"{m['time_s'] / base['time_s']:.3f} | {_fmt(mem_ratio)} |"
            )
    return "\n".join(lines)


def _agentic_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="log-probs at agentic shapes")
    p.add_argument("--agentic", action="store_true")
    p.add_argument("--shape", metavar="NxVxH", default="8192x32000x512")
    p.add_argument("--valid", type=float, default=0.03, help="fraction of valid rows")
    p.add_argument("--ids", type=positive_int, nargs="+", default=[20, 512])
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    n, v, h = (int(x) for x in args.shape.split("x"))
    # Every block above 128 KiB its own mapping, unmapped when freed (glibc's threshold fixed,
    # not raised by the first large free): the resident high-water of each fresh process is
    # then its live peak, not what malloc happened to keep.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    print(_HEADER, flush=True)
    agentic(n, v, h, args.valid, args.ids, args.repeats,
            on_row=lambda row: print(agentic_report([row]), flush=True))  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Options given explicitly win over the --quick sizes.",
    )
    p.add_argument("--quick", action="store_true", help="small shapes (1-2 minutes)")
    p.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="which variants to measure (default: all)",
    )  # fmt: skip
    for name, metavar, kind, what in (
        ("linear", "NxV", shape, "tokens x vocabulary of the linear cases"),
        ("hidden", "H", positive_int, "hidden sizes of the linear cases"),
        ("logits", "TxV", shape, "tokens x vocabulary of the logits cases"),
        ("threads", "N", positive_int, "torch threads per process: the logits cases run at "
         "each, the linear cases at the largest"),
    ):  # fmt: skip
        p.add_argument(
            f"--{name}", metavar=metavar, type=kind, nargs="+", help=f"{what} {_sizes(name)}"
        )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), nargs="+",
        help=f"dtypes of the linear cases {_sizes('dtype')}",
    )  # fmt: skip
    p.add_argument(
        "--contention", metavar="N", type=non_negative_int, default=0,
        help="also measure the logits cases while N busy processes run (default 0: not)",
    )  # fmt: skip
    p.add_argument(
        "--top-p", metavar="P", type=top_p, default=0.9,
        help="the top-p of the top-p variants (default 0.9)",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", type=writable_path, help="also save everything")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if "--agentic" in argv:
        _agentic_main(argv)
        return {}
    args = parser().parse_args(argv)
    sizes = QUICK if args.quick else FULL
    kw = {k: getattr(args, k) or sizes[k] for k in FULL}
    print(report({"method": METHOD, "cases": []}), flush=True)

    def show(case: dict) -> None:
        print("\n" + case_report(case), flush=True)

    res = run(
        **kw, contention=args.contention, top_p=args.top_p, sections=args.sections, on_case=show
    )
    res["config"]["quick"] = args.quick
    print("\n" + summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nmeasurements written to {args.json}")
    return res


if __name__ == "__main__":
    main()
