"""The torch.compile table: for every case of ``tests/api/test_compile.py`` (each public function
and the adapters' hot functions), whether it compiles with ``fullgraph=True``, the time of the
first compiled forward + backward (Inductor on this machine's CPU, less the eager run), and for
the ``[B, T]`` functions the recompiles that three new lengths cause under ``dynamic=True``.

    python benchmarks/compile_table.py [--json out.json] [NAME ...]

Prints a Markdown table (the one in docs/compile.md). Each case starts from a reset Dynamo
cache, but Inductor's on-disk cache is kept: run it once to warm the C++ compiler's cache, or pass
``--cold`` to point Inductor at a fresh cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="cases to run (default: all)")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--cold", action="store_true", help="a fresh Inductor cache folder")
    args = p.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    sys.path.insert(0, str(ROOT))
    import torch
    from tests.api.test_compile import CASES, DYNAMIC, _count_graphs, compile_inputs, run_case

    rows = []
    for name in args.names or sorted(CASES):
        fn, grads = CASES[name]
        d64 = compile_inputs(4, 37)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        run_case(fn, d64, grads, torch.float32, compiled=False)
        eager = time.perf_counter() - t0
        row = {"function": name, "fullgraph": True, "backward": bool(grads)}
        t0 = time.perf_counter()
        try:
            run_case(fn, d64, grads, torch.float32, compiled=True)
        except Exception as e:  # the table reports it; the test fails on it
            row.update(fullgraph=False, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        row["compile_s"] = round(time.perf_counter() - t0 - eager, 2)
        if row["fullgraph"]:  # Inductor for DYNAMIC, Dynamo's eager backend for the rest
            backend = "inductor" if name in DYNAMIC else "eager"
            row["recompiles_over_3_new_T"], _ = _count_graphs(name, backend=backend)
            row["recompiles_backend"] = backend
        rows.append(row)
        print(f"{name}: {row}", file=sys.stderr, flush=True)

    print("| function | fullgraph | backward | compile (s) | recompiles, 3 new T |")
    print("|---|---|---|---|---|")
    for r in rows:
        rec = r.get("recompiles_over_3_new_T", "")
        rec = f"{rec} ({r['recompiles_backend']})" if rec != "" else rec
        print(f"| `{r['function']}` | {'yes' if r['fullgraph'] else 'no'} | "
              f"{'yes' if r['backward'] else '-'} | {r['compile_s']:.1f} | {rec} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
