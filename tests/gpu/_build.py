"""rlops's Triton kernels as the compiler builds them for real GPUs, on a machine without one.

Run as ``python -m tests.gpu._build --target sm_90 --json out.json`` (one process per target:
the active driver is process-wide). The process makes triton's active driver report the
target's ``GPUTarget`` (``("cuda", 90, 32)``, ``("hip", "gfx942", 64)``, ...) with device and
stream 0, imports the kernel modules (so they are real ``JITFunction`` objects, not the
interpreter's), then sets ``TRITON_INTERPRET=1`` only so that rlops's dispatch accepts CPU
tensors: the kernels stay compiled ones, and every launch is turned into ``warmup=True``
(compile, return the ``CompiledKernel``, run nothing). The public functions
(``rlops.discounted_cumsum``, ``rlops.gae``, ``rlops.discounted_returns``,
``rlops.reinforce_plus_plus_returns``, ``rlops.logprobs_and_entropy`` and their backward)
are then called at production shapes; their outputs are garbage (nothing ran) and unused.

Targets (:data:`TARGETS`): NVIDIA sm_90 (H100), sm_80 (A100), sm_100 (B200) and sm_120
(RTX 50xx), built by the wheel's ``ptxas`` (sm_80) or ``ptxas-blackwell`` (sm_90 on) and read
with its ``cuobjdump --dump-resource-usage`` and the PTX; AMD gfx942 (MI300X) and gfx950
(MI355X), built by the AMD backend in process, read from the assembly's AMDGPU metadata.

Each distinct kernel built is reported once: its case, grid, warps and what the binary says —
registers (VGPRs on AMD), spills (CUDA: stack and local memory; AMD: VGPR and SGPR spills and
scratch), shared memory (LDS on AMD; static plus the launch's dynamic), the widest global load,
scalar 16-bit global loads, cross-lane shuffles (``shfl.sync``; AMD: DPP, swizzles and
permutes).

``python -m tests.gpu._build --docs docs/gpu.md`` builds every target whose compiler the wheel
ships and writes the build tables of ``docs/gpu.md`` (``--table`` prints them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to build for: triton's ``GPUTarget(backend, arch, warp_size)`` and its limits."""

    name: str
    backend: str  # "cuda" | "hip"
    arch: int | str
    warp_size: int
    shared_limit: int  # bytes of shared memory (LDS) one block may use
    gpu: str  # a device of this target, for the docs

    def missing(self) -> str | None:
        """What this triton wheel lacks to build for the target, or None."""
        spec = importlib.util.find_spec("triton")
        if spec is None or spec.origin is None:
            return "triton"
        root = os.path.dirname(spec.origin)
        if self.backend == "cuda":
            tools = ("ptxas" if int(self.arch) < 90 else "ptxas-blackwell", "cuobjdump")
            absent = [t for t in tools if not os.path.exists(_bin(t, root))]
            return ", ".join(absent) or None
        if not os.path.isdir(os.path.join(root, "backends", "amd")):
            return "triton's AMD backend"
        return None


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_90", "cuda", 90, 32, 232_448, "H100"),
        Target("sm_80", "cuda", 80, 32, 166_912, "A100"),
        Target("sm_100", "cuda", 100, 32, 232_448, "B200"),
        Target("sm_120", "cuda", 120, 32, 101_376, "RTX 5090"),
        Target("gfx942", "hip", "gfx942", 64, 65_536, "MI300X"),
        Target("gfx950", "hip", "gfx950", 64, 163_840, "MI355X"),
    )
}
GRID_LIMIT = (2**31 - 1, 65_535, 65_535)
LONG_T = 2**21  # beyond the 65,535 blocks of grid dimension 1 at block_t = 16

_LD = re.compile(r"ld\.global((?:\.[a-z0-9]+)*)")
_SHFL = re.compile(r"shfl\.sync")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_AMD_META = {
    key: re.compile(rf"\.{field}:\s+(\d+)")
    for key, field in (
        ("regs", "vgpr_count"),
        ("sgprs", "sgpr_count"),
        ("agprs", "agpr_count"),
        ("vgpr_spills", "vgpr_spill_count"),
        ("sgpr_spills", "sgpr_spill_count"),
        ("shared", "group_segment_fixed_size"),
        ("scratch", "private_segment_fixed_size"),
        ("wavefront", "wavefront_size"),
    )
}
_AMD_LD = re.compile(
    r"\b(?:global|buffer)_load_(dwordx[234]|dword|b128|b96|b64|b32|ubyte|sbyte|ushort|sshort|"
    r"short_d16\w*|ubyte_d16\w*|u16|u8|i16|i8)\b"
)
_AMD_BITS = {"dword": 32, "dwordx2": 64, "dwordx3": 96, "dwordx4": 128, "b32": 32, "b64": 64,
             "b96": 96, "b128": 128, "ubyte": 8, "sbyte": 8, "u8": 8, "i8": 8}  # fmt: skip
_AMD_XLANE = re.compile(r"\b(?:ds_swizzle\w*|ds_bpermute\w*|ds_permute\w*|v_permlane\w*)|_dpp\b|"
                        r"\brow_(?:shr|bcast|ror|newbcast):")  # fmt: skip


def _bin(name: str, root: str | None = None) -> str:
    if root is None:
        import triton

        root = os.path.dirname(triton.__file__)
    return os.path.join(root, "backends", "nvidia", "bin", name)


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


def amd_usage(asm: str) -> dict:
    """What the AMDGPU assembly's metadata and instructions say of a kernel: VGPRs
    (``regs``), SGPRs, AGPRs, spills, LDS (``shared``), scratch, the wavefront size, the widest
    global load, scalar 16-bit global loads and cross-lane operations."""
    out: dict = {}
    for key, rx in _AMD_META.items():
        m = rx.search(asm)
        out[key] = int(m.group(1)) if m else 0
    widths = [_AMD_BITS.get(m.group(1), 16) for m in _AMD_LD.finditer(asm)]
    out["ld_bits"] = max(widths, default=0)
    out["ld16_scalar"] = sum(w == 16 for w in widths)
    out["ld_global"] = len(widths)
    out["shfl"] = len(_AMD_XLANE.findall(asm))
    return out


def spills(row: dict) -> int:
    """Bytes (CUDA: stack and local memory; AMD: scratch) plus spilled registers (AMD)."""
    if "stack" in row:
        return row["stack"] + row["local"]
    return row["scratch"] + row["vgpr_spills"] + row["sgpr_spills"]


def shared(row: dict) -> int:
    """Shared memory (LDS) of a launch: the binary's static plus the launch's dynamic."""
    return row["shared"] + row["dyn_shared"]


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
def build(target: str, only: str | None = None) -> list[dict]:
    """Build every case for ``target`` (a key of :data:`TARGETS`) in this process (it takes
    the process's driver)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    spec = TARGETS[target]

    class _Driver:  # what triton asks the active driver at a launch
        def __init__(self) -> None:
            self.target = GPUTarget(spec.backend, spec.arch, spec.warp_size)

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(_Driver())
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
            rows.append(
                {"case": name, "target": target, "error": f"{type(e).__name__}: {e}"[:2000]}
            )
            continue
        for kname, grid, kernel in launches:
            key = (kname, kernel.hash)
            row = {"case": name, "target": target, "kernel": kname, "grid": grid}
            if key in seen:
                rows.append({**row, "dup": True})
                continue
            seen.add(key)
            if spec.backend == "cuda":
                widest, scalar16, loads = ptx_loads(kernel.asm["ptx"])
                usage = {**_usage(kernel.asm["cubin"]), "ld_bits": widest,
                         "ld16_scalar": scalar16, "ld_global": loads,
                         "shfl": len(_SHFL.findall(kernel.asm["ptx"]))}  # fmt: skip
            else:
                usage = amd_usage(kernel.asm["amdgcn"])
            rows.append({
                **row, "dup": False, **usage,
                "dyn_shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                "seconds": round(time.perf_counter() - start, 2),
            })  # fmt: skip
    del triton
    return rows


def build_in_subprocess(target: str, only: str | None = None, timeout: float = 900) -> list[dict]:
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
        cmd = [sys.executable, "-m", "tests.gpu._build", "--target", target, "--json", out]
        if only:
            cmd += ["--only", only]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"build for {target} failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def build_targets(
    targets: list[str], only: str | None = None, workers: int | None = None
) -> dict[str, list[dict]]:
    """:func:`build_in_subprocess` for each target, a few at a time (one per core)."""
    workers = workers or max(1, min(len(targets), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        built = pool.map(lambda t: build_in_subprocess(t, only), targets)
        return dict(zip(targets, built, strict=True))


# --------------------------------------------------------------------------- reports
def table(rows: list[dict]) -> str:
    """The Markdown build table of one target's rows (distinct kernels, one line each)."""
    lines = [
        "| kernel | variant (public call) | target | registers | spills | shared B | "
        "widest global load | scalar 16-bit loads | shuffles |",
        "|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| — | {r['case']} | {r['target']} | build failed: {r['error'][:80]} |")
            continue
        if r["dup"]:
            continue
        width = f"{r['ld_bits']}-bit" if r["ld_bits"] else "—"
        lines.append(
            f"| `{r['kernel']}` | {r['case']} | {r['target']} | {r['regs']} | {spills(r)} | "
            f"{shared(r)} | {width} | {r['ld16_scalar']} | {r['shfl']} |"
        )
    return "\n".join(lines)


_SCAN_KERNELS = ("_scan_block", "_estimator_block")
_SCAN_FAMILY = (*_SCAN_KERNELS, "_carry_kernel")


def target_line(target: str, rows: list[dict]) -> dict:
    """One target's figures: kernels built, failures, kernels that spill, the most registers
    of the scan family's kernels and of the log-prob kernels, the most shared memory, and the
    narrowest of the widest loads of the scan and estimator kernels (the ``block_t = 16`` case
    aside) and of the log-prob kernels that read the logits tile (the contiguous
    odd-vocabulary case aside: docs/gpu.md)."""
    built = [r for r in rows if not r.get("dup", True)]
    scan = [r for r in built if r["kernel"] in _SCAN_FAMILY]
    logp = [r for r in built if r["kernel"] not in _SCAN_FAMILY]
    scan_ld = [r["ld_bits"] for r in scan if r["kernel"] in _SCAN_KERNELS
               and "block_t=16" not in r["case"]]  # fmt: skip
    tile_ld = [r["ld_bits"] for r in logp if r["kernel"] in ("_stats_kernel", "_grad_kernel")
               and "V=50257 bfloat16" not in r["case"]]  # fmt: skip
    return {
        "target": target,
        "built": len(built),
        "failures": sum("error" in r for r in rows),
        "spilling": sum(spills(r) > 0 for r in built),
        "scan_regs": max((r["regs"] for r in scan), default=0),
        "logprob_regs": max((r["regs"] for r in logp), default=0),
        "shared": max((shared(r) for r in built), default=0),
        "scan_ld_bits": min(scan_ld, default=0),
        "tile_ld_bits": min(tile_ld, default=0),
    }


def summary(by_target: dict[str, list[dict]]) -> str:
    """The Markdown table of every target, one line each."""
    lines = [
        "| target | GPU | kernels | failures | spilling | most registers: scan family / "
        "log-prob | most shared B (limit) | scan family's loads | logits tile's loads |",
        "|---|---|---:|---:|---:|---|---|---|---|",
    ]
    for target, rows in by_target.items():
        s, spec = target_line(target, rows), TARGETS[target]
        unit = " VGPRs" if spec.backend == "hip" else ""
        lines.append(
            f"| {target} | {spec.gpu} | {s['built']} | {s['failures']} | {s['spilling']} | "
            f"{s['scan_regs']} / {s['logprob_regs']}{unit} | {s['shared']} "
            f"({spec.shared_limit}) | {s['scan_ld_bits']}-bit | {s['tile_ld_bits']}-bit |"
        )
    return "\n".join(lines)


BEGIN, END = "<!-- build table: begin -->", "<!-- build table: end -->"


def write_docs(path: str, by_target: dict[str, list[dict]], detail: str = "sm_90") -> None:
    """Replace the text between the build-table markers of ``path``: the summary of every
    target, then ``detail``'s table of kernels."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    body = f"{summary(by_target)}\n\n{detail}:\n\n{table(by_target[detail])}\n"
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{body}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=TARGETS, default=None, help="build in this process")
    p.add_argument("--targets", default=None,
                   help="comma-separated targets, each in a subprocess (default: every target "
                   "whose compiler this wheel ships)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--rows", default=None, help="read the rows from here instead of building")
    p.add_argument("--only", default=None, help="cases whose name contains this")
    p.add_argument("--table", action="store_true", help="print the Markdown build tables")
    p.add_argument("--docs", default=None, help="write the tables into this page's markers")
    args = p.parse_args(argv)
    if args.rows:
        with open(args.rows) as f:
            rows = json.load(f)
    elif args.target is not None:
        rows = build(args.target, args.only)
    else:
        names = args.targets.split(",") if args.targets else list(TARGETS)
        for name in names:
            reason = TARGETS[name].missing()
            if reason:
                print(f"skipped {name}: this triton wheel lacks {reason}", file=sys.stderr)
        names = [n for n in names if TARGETS[n].missing() is None]
        rows = [r for built in build_targets(names, args.only).values() for r in built]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    by_target: dict[str, list[dict]] = {}
    for r in rows:
        by_target.setdefault(r["target"], []).append(r)
    if args.docs:
        write_docs(args.docs, by_target)
    if args.table or not (args.json or args.docs):
        print(summary(by_target))
        for target, built in by_target.items():
            print(f"\n{target}:\n\n{table(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
