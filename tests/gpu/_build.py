"""rlops's Triton kernels as the compiler builds them for a real GPU, on a machine without one.

Run as ``python -m tests.gpu._build --arch 90 --json out.json`` (one process per target: the
active driver is process-wide). The process makes triton's active driver report
``GPUTarget("cuda", arch, 32)`` with device and stream 0, imports the kernel modules (so they
are real ``JITFunction`` objects, not the interpreter's), then sets ``TRITON_INTERPRET=1`` only
so that rlops's dispatch accepts CPU tensors: the kernels stay compiled ones, and every launch
is turned into ``warmup=True`` (compile, return the ``CompiledKernel``, run nothing). The
public functions (``rlops.discounted_cumsum``, ``rlops.gae``, ``rlops.discounted_returns``,
``rlops.reinforce_plus_plus_returns``, ``rlops.logprobs_and_entropy`` and their backward)
are then called at production shapes; their outputs are garbage (nothing ran) and unused.

Each distinct kernel built is reported once: its case, grid, and what the cubin (built by the
wheel's ``ptxas``; ``cuobjdump --dump-resource-usage``) and the PTX say: registers, stack
(spills), shared memory (the cubin's static and the launch's dynamic), the widest global
load, scalar 16-bit global loads, shuffles.

``python -m tests.gpu._build --docs docs/gpu.md`` builds for both targets and writes the
build table of ``docs/gpu.md`` (``--table`` prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

TARGETS = (90, 80)
SHARED_LIMIT = {90: 232_448, 80: 166_912}  # bytes of shared memory a block may use
GRID_LIMIT = (2**31 - 1, 65_535, 65_535)
LONG_T = 2**21  # beyond the 65,535 blocks of grid dimension 1 at block_t = 16

_LD = re.compile(r"ld\.global((?:\.[a-z0-9]+)*)")
_SHFL = re.compile(r"shfl\.sync")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptx_loads(ptx: str) -> tuple[int, int, int]:
    """``(widest global load in bits, scalar 16-bit global loads, global loads)`` in ``ptx``."""
    widest, scalar16, total = 0, 0, 0
    for m in _LD.finditer(ptx):
        parts = m.group(1).split(".")[1:]
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in parts if re.fullmatch(r"[bufs]\d+", p)), 0)
        widest = max(widest, vec * bits)
        scalar16 += vec == 1 and bits == 16
        total += 1
    return widest, scalar16, total


def _usage(cubin: bytes) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [_bin("cuobjdump"), "--dump-resource-usage", path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    m = _USAGE.search(out)
    assert m is not None, out
    regs, stack, shared, local = map(int, m.groups())
    return {"regs": regs, "stack": stack, "shared": shared, "local": local}


# --------------------------------------------------------------------------- the cases
def _cases() -> list[tuple[str, Callable[[], None]]]:
    import torch

    import rlops
    from rlops.scan.triton import reverse_scan

    gen = torch.Generator().manual_seed(0)
    cases: list[tuple[str, Callable[[], None]]] = []

    def add(name):
        def deco(fn):
            cases.append((name, fn))
            return fn

        return deco

    b, t = 8, 131072
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        dn = str(dtype).removeprefix("torch.")
        for kind in ("row", "token"):

            @add(f"discounted_cumsum {kind} {dn} fwd+bwd")
            def _(dtype=dtype, kind=kind):
                x = torch.randn(b, t, dtype=dtype, generator=gen).requires_grad_()
                a = torch.rand(b, 1 if kind == "row" else t, dtype=dtype, generator=gen)
                a.requires_grad_()
                rlops.discounted_cumsum(x, a, method="triton").sum().backward()

    @add("reverse_scan T=2^21 block_t=16 float32 fwd+bwd")
    def _():
        x = torch.randn(1, LONG_T, generator=gen).requires_grad_()
        reverse_scan(x, 0.99, block_t=16).sum().backward()

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        dn = str(dtype).removeprefix("torch.")

        @add(f"gae mask+dones {dn}")
        def _(dtype=dtype):
            r, v = (torch.randn(b, t, dtype=dtype, generator=gen) for _ in range(2))
            m = torch.rand(b, t, generator=gen) < 0.8
            d = torch.rand(b, t, generator=gen) < 0.01
            rlops.gae(r, v, gamma=0.99, lam=0.95, mask=m, dones=d, method="triton")

    @add("gae plain float32")
    def _():
        r, v = (torch.randn(b, t, generator=gen) for _ in range(2))
        rlops.gae(r, v, gamma=0.99, lam=0.95, method="triton")

    @add("gae bootstrap [B, T] + truncated float32")
    def _():
        r, v, boot = (torch.randn(b, t, generator=gen) for _ in range(3))
        d = torch.rand(b, t, generator=gen) < 0.01
        rlops.gae(r, v, gamma=0.99, lam=0.95, dones=d, bootstrap=boot, truncated=d,
                  method="triton")  # fmt: skip

    @add("gae T=2^21 float32")
    def _():
        r, v = (torch.randn(1, LONG_T, generator=gen) for _ in range(2))
        rlops.gae(r, v, gamma=0.99, lam=0.95, method="triton")

    @add("discounted_returns mask+dones+bootstrap [B] float32")
    def _():
        r = torch.randn(b, t, generator=gen)
        m = torch.rand(b, t, generator=gen) < 0.8
        d = torch.rand(b, t, generator=gen) < 0.01
        rlops.discounted_returns(r, gamma=0.99, mask=m, dones=d, bootstrap=torch.randn(b),
                                 method="triton")  # fmt: skip

    @add("reinforce_plus_plus_returns float32")
    def _():
        kl = torch.randn(b, t, generator=gen)
        m = torch.rand(b, t, generator=gen) < 0.8
        rlops.reinforce_plus_plus_returns(torch.randn(b), kl, m, kl_coef=0.1, gamma=0.99,
                                          method="triton")  # fmt: skip

    n = 4
    for v in (151936, 50280):
        for dn, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            if dtype == torch.float32 and v != 151936:
                continue
            for label, kw in (
                ("plain", {}),
                ("temperature", {"temperature": 0.7}),
                ("no entropy", {"with_entropy": False}),
                ("keep_mask", {"keep_mask": True}),
                ("top_k+top_p", {"top_k": 50, "top_p": 0.9, "temperature": 0.7}),
                ("min_p", {"min_p": 0.05}),
                ("Σπ²", {"with_sum_pi_squared": True}),
                ("row mask", {"mask": True}),
            ):
                name = f"logprobs_and_entropy V={v} {dn} {label} fwd+bwd"
                cases.append((name, _logprobs_case(n, v, dtype, kw, gen)))

    for v in (16384, 50257):  # one vocabulary slice (no merge); an odd vocabulary
        for label, kw in (("plain", {}), ("keep_mask", {"keep_mask": True})):
            name = f"logprobs_and_entropy V={v} bfloat16 {label} fwd+bwd"
            cases.append((name, _logprobs_case(n, v, torch.bfloat16, kw, gen)))
    # V = 50257 as a view of rows padded to 50304 (a padded output layer's logits, sliced)
    name = "logprobs_and_entropy V=50257 row stride 50304 bfloat16 plain fwd+bwd"
    cases.append((name, _logprobs_case(n, 50257, torch.bfloat16, {"pad_to": 50304}, gen)))

    return cases


def _logprobs_case(n, v, dtype, kw, gen) -> Callable[[], None]:
    import torch

    import rlops

    def run() -> None:
        extra = dict(kw)
        width = extra.pop("pad_to", v)
        x = torch.randn(n, width, generator=gen).to(dtype).requires_grad_()
        x = x[:, :v] if width != v else x
        y = torch.randint(0, v, (n,), generator=gen)
        if extra.get("keep_mask"):
            extra["keep_mask"] = torch.rand(n, v, generator=gen) < 0.5
        if extra.get("mask"):
            extra["mask"] = torch.tensor([True, False] * (n // 2))
        out = rlops.logprobs_and_entropy(x, y, method="triton", **extra)
        sum(o.float().sum() for o in out if o is not None).backward()

    return run


# --------------------------------------------------------------------------- one target
def build(arch: int, only: str | None = None) -> list[dict]:
    """Build every case for ``sm_<arch>`` in this process (it takes the process's driver)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class _Target:  # what triton asks the active driver at a launch
        def __init__(self) -> None:
            self.target = GPUTarget("cuda", arch, 32)

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_Target())
    import rlops.advantages.triton
    import rlops.logprobs.triton
    import rlops.scan.triton

    assert isinstance(rlops.scan.triton._scan_block, JITFunction)
    os.environ["TRITON_INTERPRET"] = "1"  # rlops's dispatch: CPU tensors may take triton

    launches: list = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self.fn.__name__, tuple(grid), kernel))
        return kernel

    JITFunction.run = run
    rows: list[dict] = []
    seen: set = set()
    for name, fn in _cases():
        if only is not None and only not in name:
            continue
        launches.clear()
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a build failure is a finding: reported, asserted on
            rows.append({"case": name, "arch": arch, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        for kname, grid, kernel in launches:
            key = (kname, kernel.hash)
            if key in seen:
                rows.append({"case": name, "arch": arch, "kernel": kname, "grid": grid,
                             "dup": True})  # fmt: skip
                continue
            seen.add(key)
            widest, scalar16, loads = ptx_loads(kernel.asm["ptx"])
            rows.append({
                "case": name, "arch": arch, "kernel": kname, "grid": grid, "dup": False,
                **_usage(kernel.asm["cubin"]),
                "dyn_shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                "ld_bits": widest, "ld16_scalar": scalar16, "ld_global": loads,
                "shfl": len(_SHFL.findall(kernel.asm["ptx"])),
                "seconds": round(time.perf_counter() - start, 2),
            })  # fmt: skip
    del triton
    return rows


def build_in_subprocess(arch: int, only: str | None = None, timeout: float = 600) -> list[dict]:
    """:func:`build` in a fresh interpreter (the driver is process-wide)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(root, "src"), root, env.get("PYTHONPATH", "")]
    )
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "tests.gpu._build", "--arch", str(arch), "--json", out]
        if only:
            cmd += ["--only", only]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"build for sm_{arch} failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def table(rows: list[dict]) -> str:
    """The Markdown build table (distinct kernels, one line each)."""
    lines = [
        "| kernel | variant (public call) | target | registers | spills (stack B) | "
        "shared B | widest global load | scalar 16-bit loads | shuffles |",
        "|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| — | {r['case']} | sm_{r['arch']} | build failed: {r['error'][:80]} |")
            continue
        if r["dup"]:
            continue
        width = f"{r['ld_bits']}-bit" if r["ld_bits"] else "—"
        lines.append(
            f"| `{r['kernel']}` | {r['case']} | sm_{r['arch']} | {r['regs']} | {r['stack']} | "
            f"{r['shared'] + r['dyn_shared']} | {width} | {r['ld16_scalar']} | {r['shfl']} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """One line per target: kernels built, the most registers, spills, shared memory."""
    out = []
    for arch in sorted({r["arch"] for r in rows}, reverse=True):
        built = [r for r in rows if r["arch"] == arch and not r.get("dup", True)]
        failed = [r for r in rows if r["arch"] == arch and "error" in r]
        out.append(
            f"- sm_{arch}: {len(built)} distinct kernels built, {len(failed)} failures; at most "
            f"{max(r['regs'] for r in built)} registers, "
            f"{sum(r['stack'] > 0 or r['local'] > 0 for r in built)} with spills, at most "
            f"{max(r['shared'] + r['dyn_shared'] for r in built)} B of shared memory"
        )
    return "\n".join(out)


BEGIN, END = "<!-- build table: begin -->", "<!-- build table: end -->"


def write_docs(path: str, rows: list[dict]) -> None:
    """Replace the text between the build-table markers of ``path``."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    body = f"{summary(rows)}\n\nsm_90:\n\n{table([r for r in rows if r['arch'] == 90])}\n"
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{body}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=None, help="build in this process for sm_ARCH")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--rows", default=None, help="read the rows from here instead of building")
    p.add_argument("--only", default=None, help="cases whose name contains this")
    p.add_argument("--table", action="store_true", help="print the Markdown build table")
    p.add_argument("--docs", default=None, help="write the table into this page's markers")
    args = p.parse_args(argv)
    if args.rows:
        with open(args.rows) as f:
            rows = json.load(f)
    elif args.arch is not None:
        rows = build(args.arch, args.only)
    else:
        rows = [r for arch in TARGETS for r in build_in_subprocess(arch, args.only)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    if args.docs:
        write_docs(args.docs, rows)
    if args.table or not (args.json or args.docs):
        print(summary(rows))
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
