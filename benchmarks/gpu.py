"""The prepared GPU check: the Triton kernels against the references and the chunked paths at
production shapes, and their speed side by side, in one process within a few minutes.

    PYTHONPATH=src python benchmarks/gpu.py       # on a CUDA device (no install, no extras)
    python benchmarks/gpu.py --dry-run            # the same script on CPU under the Triton
                                                  # interpreter, at tiny shapes (CI)

The report goes to ``--json`` (default ``$OUT/gpu.json`` when ``OUT`` is set, else
``gpu.json``) and is written again after every section, each run under its own ``try``: a
Triton error or running out of memory in one section leaves the figures of the others.

Correctness (errors against float64, the rule of ``tests/tolerances.py``: at most twice the
float32 yardstick's error plus a few ulps of the output's magnitude):

* GAE with a mask and dones at 8 x 131072 and 256 x 8192, float32: Triton and the chunked
  path against a float64 oracle (the chunked path run in float64); the yardstick is the serial
  float32 reference where it is affordable (256 x 8192), else the chunked float32 path;
* log-prob + entropy, forward and backward, at N = 32768, V = 151936 in float32 and bfloat16:
  Triton and the chunked path (``rlops.logprobs_and_entropy`` with ``method="triton"`` and
  ``method="chunked"``) against the unfused reference in float64, row block by row block
  (the float32 reference is the yardstick).

Timings, side by side: the median over a few windows, each one pair of CUDA events around many
back-to-back calls (enough for ~20 ms of device work), so the host's dispatch of a call
overlaps the device's work on the previous ones instead of being timed with it:

* GAE at 256 x 131072 float32: Triton, the chunked path, the chunk loop trainers ship (a
  C x C decay matmul per chunk, carries passed by a Python loop over chunks), torchrl's
  vectorised GAE when installed; and the bare Triton scan. Each as effective bandwidth (the
  bytes a single pass must move) over the device's measured copy bandwidth;
* log-prob + entropy forward + backward at N = 32768, V = 151936 bfloat16: Triton against
  ``log_softmax`` + gather (and with the entropy), against Liger's cross entropy when
  installed; the peak memory beyond the inputs and their gradient (``x.grad``, N·V, which
  every path allocates), from ``torch.cuda.max_memory_allocated``, for every side.

Writes one JSON file and prints a short verdict. Goals (``docs/gpu.md``): the scan at >= 50%
of copy bandwidth at 256 x 131072; the fused log-prob forward + backward at <= 1.2x the time
of ``log_softmax`` + gather with <= 0.1x its extra memory at N = 32768, V = 151936, bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

import rlops  # noqa: E402
from rlops.advantages.masking import GaeInputs  # noqa: E402
from rlops.advantages.triton import gae_triton  # noqa: E402
from rlops.logprobs.reference import logprobs_and_entropy_reference  # noqa: E402
from rlops.measure.baselines import gae_chunk_loop  # noqa: E402
from rlops.scan.triton import reverse_scan  # noqa: E402

FLOOR_ULPS = 4

FULL = {
    "gae_cases": [(8, 131072), (256, 8192)],
    "serial_max_t": 8192,
    "lp_case": (32768, 151936),
    "lp_rows": 2048,
    "gae_time": (256, 131072),
    "lp_time": (32768, 151936),
    "reps": 5,
}
TINY = {
    "gae_cases": [(2, 200), (3, 129)],
    "serial_max_t": 8192,
    "lp_case": (12, 300),
    "lp_rows": 5,
    "gae_time": (2, 256),
    "lp_time": (8, 300),
    "reps": 1,
}


def torchrl_gae():
    """torchrl's vectorised GAE as ``fn(rewards, values, gamma, lam)``, or None."""
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except Exception:
        return None

    def run(r, v, gamma, lam):
        nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
        done = torch.zeros_like(r, dtype=torch.bool).unsqueeze(-1)
        return vec_generalized_advantage_estimate(
            gamma, lam, v.unsqueeze(-1), nxt.unsqueeze(-1), r.unsqueeze(-1), done, done
        )

    return run


def liger_logprobs():
    """Liger's fused cross entropy per token (``-logp``) as ``fn(logits, target)``, or None."""
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except Exception:
        return None
    return lambda x, y: -liger_cross_entropy(x, y, reduction="none")


# ------------------------------------------------------------------ measuring
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WINDOW_S = 0.02  # device time per timed window


def timed(fn, device, reps):
    """Median seconds per call of ``fn()``: ``reps`` windows of back-to-back calls between one
    pair of CUDA events (as many calls as fill ~20 ms, from a first timed call), after a
    warm-up. On CPU (the dry run) one call per window."""
    fn()
    sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    calls = max(1, min(200, int(WINDOW_S / max(start.elapsed_time(end) / 1e3, 1e-6))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def peak_extra(fn, device, beyond=0):
    """Peak bytes allocated during ``fn()`` above those allocated before it, less ``beyond``
    (the bytes every path must allocate: the gradient), on CUDA; else None."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before - beyond


def copy_bandwidth(device, reps):
    """Bytes per second of ``dst.copy_(src)`` (read + write) over 1 GiB (4 MiB dry)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 20)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    sec = timed(lambda: dst.copy_(src), device, reps)
    return 2 * src.numel() * src.element_size() / sec


def err(out, oracle):
    """Max abs difference from the oracle; NaN counts as infinite."""
    if not out.numel():
        return 0.0
    return float((out.double() - oracle).abs().nan_to_num(float("inf")).max())


def rule(name, out, oracle, yard, what):
    e, y = err(out, oracle), err(yard, oracle)
    scale = float(oracle.abs().max()) if oracle.numel() else 0.0
    floor = FLOOR_ULPS * torch.finfo(out.dtype).eps * scale
    ok = e <= 2 * y + floor
    return {"case": name, "error": e, "yardstick": what, "yardstick_error": y, "floor": floor,
            "pass": bool(ok)}  # fmt: skip


# ------------------------------------------------------------------ correctness
def gae_inputs(b, t, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = torch.randn(b, t, generator=gen, device=device)
    v = torch.randn(b, t, generator=gen, device=device)
    mask = torch.rand(b, t, generator=gen, device=device) < 0.8
    dones = torch.rand(b, t, generator=gen, device=device) < 1e-3
    return r, v, mask, dones


def check_gae(cfg, device):
    rows = []
    gamma, lam = 0.999, 0.95
    for b, t in cfg["gae_cases"]:
        r, v, m, d = gae_inputs(b, t, device)
        kw = dict(gamma=gamma, lam=lam, mask=m, dones=d)
        oracle = rlops.gae(r.double(), v.double(), method="chunked", **kw)
        g = torch.full((b,), gamma, device=device)
        tri = gae_triton(GaeInputs(r, v, m, d, g, torch.full((b,), gamma * lam, device=device)))
        chk = rlops.gae(r, v, method="chunked", **kw)
        if t <= cfg["serial_max_t"]:
            yard, what = rlops.gae(r, v, method="reference", **kw), "serial float32 reference"
        else:
            yard, what = chk, "chunked float32"
        for k, out in enumerate(("advantages", "returns")):
            rows.append(rule(f"gae {b}x{t} {out} triton", tri[k], oracle[k], yard[k], what))
            rows.append(rule(f"gae {b}x{t} {out} chunked", chk[k], oracle[k], yard[k], what))
    return rows


def _fwd_bwd(fn, logits, target, g_lp, g_ent):
    x = logits.detach().requires_grad_()
    lp, ent = fn(x, target)
    torch.autograd.backward([lp, ent], [g_lp.to(lp.dtype), g_ent.to(ent.dtype)])
    return lp.detach(), ent.detach(), x.grad


def lp_triton(x, y, **kw):
    return rlops.logprobs_and_entropy(x, y, method="triton", **kw)


def lp_chunked(x, y, **kw):
    return rlops.logprobs_and_entropy(x, y, method="chunked", **kw)


def check_logprobs(cfg, device):
    rows = []
    n, v = cfg["lp_case"]
    step = cfg["lp_rows"]
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(1)
        logits = (3 * torch.randn(n, v, generator=gen, device=device)).to(dtype)
        target = torch.randint(0, v, (n,), generator=gen, device=device)
        g_lp = torch.randn(n, generator=gen, device=device)
        g_ent = torch.randn(n, generator=gen, device=device)
        fast = {
            "triton": _fwd_bwd(lp_triton, logits, target, g_lp, g_ent),
            "chunked": _fwd_bwd(lp_chunked, logits, target, g_lp, g_ent),
        }
        worst = {(k, i): [0.0, 0.0, 0.0] for k in fast for i in range(3)}  # err, yard, scale
        for i in range(0, n, step):
            sl = slice(i, i + step)
            args = (target[sl], g_lp[sl], g_ent[sl])
            ref = logprobs_and_entropy_reference
            exact = _fwd_bwd(ref, logits[sl].double(), *args)
            ref32 = _fwd_bwd(ref, logits[sl].float(), *args)
            for k, out in fast.items():
                for j in range(3):
                    yard = ref32[j] if j < 2 else ref32[j].to(dtype)
                    w = worst[(k, j)]
                    w[0] = max(w[0], err(out[j][sl], exact[j]))
                    w[1] = max(w[1], err(yard, exact[j]))
                    w[2] = max(w[2], float(exact[j].abs().max()))
            del exact, ref32
        for (k, j), (e, y, scale) in worst.items():
            what = ("logp", "entropy", "grad")[j]
            factor = 3.0 if j == 2 else 2.0  # as tests/logprobs/test_fused.py
            floor = torch.finfo(torch.float32).eps * scale
            rows.append({
                "case": f"logprobs {n}x{v} {str(dtype)[6:]} {what} {k}", "error": e,
                "yardstick": "float32 reference", "yardstick_error": y, "floor": floor,
                "pass": bool(e <= max(factor * y, floor)),
            })  # fmt: skip
        del fast, logits
    return rows


# ------------------------------------------------------------------ timings
def time_gae(cfg, device, copy_bw):
    b, t = cfg["gae_time"]
    reps = cfg["reps"]
    r, v, _, _ = gae_inputs(b, t, device, seed=2)
    gamma, lam = 0.999, 0.95
    g = torch.full((b,), gamma, device=device)
    gl = torch.full((b,), gamma * lam, device=device)
    gae_bytes = 4 * r.numel() * 4  # read r, v; write advantages, returns (float32)
    variants = {
        "triton": lambda: gae_triton(GaeInputs(r, v, None, None, g, gl)),
        "chunked": lambda: rlops.gae(r, v, gamma=gamma, lam=lam, method="chunked"),
        "chunk loop (trainers')": lambda: gae_chunk_loop(r, v, gamma, lam),
    }
    trl = torchrl_gae()
    if trl is not None:
        variants["torchrl vectorised"] = lambda: trl(r, v, gamma, lam)
    out = {}
    for name, fn in variants.items():
        try:
            sec = timed(fn, device, reps)
            out[name] = {"seconds": sec, "fraction_of_copy_bandwidth": gae_bytes / sec / copy_bw}
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # report, keep going
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    scan_bytes = 2 * r.numel() * 4  # read x, write y
    sec = timed(lambda: reverse_scan(r, gamma * lam), device, reps)
    out["triton scan (discounted_cumsum)"] = {
        "seconds": sec,
        "fraction_of_copy_bandwidth": scan_bytes / sec / copy_bw,
    }
    return out


def time_logprobs(cfg, device):
    n, v = cfg["lp_time"]
    reps = cfg["reps"]
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(3)
    logits = (3 * torch.randn(n, v, generator=gen, device=device)).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    g = torch.randn(n, generator=gen, device=device)

    def lsm_gather(x, y):
        return torch.log_softmax(x.float(), -1).gather(-1, y[:, None]).squeeze(-1)

    def lsm_gather_entropy(x, y):
        lp = torch.log_softmax(x.float(), -1)
        return lp.gather(-1, y[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)

    def tri_logp(x, y):
        return lp_triton(x, y, with_entropy=False)[0]

    variants = {
        "log_softmax + gather": (lsm_gather, False),
        "log_softmax + gather + entropy": (lsm_gather_entropy, True),
        "triton logp": (tri_logp, False),
        "triton logp + entropy": (lp_triton, True),
        "chunked logp + entropy": (lp_chunked, True),
    }
    lig = liger_logprobs()
    if lig is not None:
        variants["liger cross entropy (logp)"] = (lig, False)
    out = {}
    for name, (fn, two) in variants.items():

        def step(fn=fn, two=two):
            x = logits.detach().requires_grad_()
            res = fn(x, target)
            if two:
                torch.autograd.backward(list(res), [g, g])
            else:
                res.backward(g)
            return x.grad

        grad_bytes = logits.numel() * logits.element_size()  # x.grad: every path's
        try:
            sec = timed(step, device, reps)
            out[name] = {
                "seconds": sec,
                "peak_extra_bytes": peak_extra(step, device, beyond=grad_bytes),
            }
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _ratio(a, b, key):
    if key in a and key in b and a[key] and b[key]:
        return a[key] / b[key]
    return None


def verdict(report):
    lines = []
    correctness = [r for key in ("correctness_gae", "correctness_logprobs")
                   for r in (report.get(key) or []) if isinstance(r, dict)]  # fmt: skip
    bad = [r["case"] for r in correctness if not r["pass"]]
    lines.append("correct: all cases within the rule" if not bad else f"FAILED: {bad}")
    for name, message in report.get("errors", {}).items():
        lines.append(f"SECTION FAILED {name}: {message}")
    for message in report.get("fallbacks", []):
        lines.append(f"FALLBACK (the Triton timings are the chunked path's): {message}")
    gae = report.get("timings_gae") or {}
    for name, row in gae.items():
        if "fraction_of_copy_bandwidth" in row:
            lines.append(f"{name}: {row['seconds'] * 1e3:.3f} ms, "
                         f"{row['fraction_of_copy_bandwidth']:.1%} of copy bandwidth")  # fmt: skip
    lp = report.get("timings_logprobs") or {}
    base, fused = lp.get("log_softmax + gather", {}), lp.get("triton logp + entropy", {})
    t_ratio = _ratio(fused, base, "seconds")
    m_ratio = _ratio(fused, base, "peak_extra_bytes")
    goals = report["goals"]
    scan = gae.get("triton scan (discounted_cumsum)", {}).get("fraction_of_copy_bandwidth")
    goals["scan >= 50% of copy bandwidth"] = None if scan is None else bool(scan >= 0.5)
    goals["fused fwd+bwd <= 1.2x log_softmax + gather"] = (
        None if t_ratio is None else bool(t_ratio <= 1.2)
    )
    goals["fused extra memory <= 0.1x log_softmax + gather"] = (
        None if m_ratio is None else bool(m_ratio <= 0.1)
    )
    if t_ratio is not None:
        lines.append(
            f"triton logp + entropy / log_softmax + gather: time {t_ratio:.2f}x"
            + ("" if m_ratio is None else f", extra memory {m_ratio:.3f}x")
        )
    lines.append("goals: " + ", ".join(f"{k}: {v}" for k, v in goals.items()))
    if report["dry_run"]:
        lines.append("(dry run: CPU, Triton interpreter, tiny shapes; timings mean nothing)")
    return lines


SECTIONS = ("copy_bandwidth", "correctness_gae", "correctness_logprobs", "timings_gae",
            "timings_logprobs")  # fmt: skip


def default_json() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu.json") if out else "gpu.json"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument(
        "--json",
        default=default_json(),
        help="where to write the report (default $OUT/gpu.json, else gpu.json)",
    )
    p.add_argument(
        "--fail-section",
        choices=SECTIONS,
        default=None,
        help="raise at the start of this section (tests the report's resilience)",
    )
    p.add_argument(
        "--kill-section",
        choices=SECTIONS,
        default=None,
        help="end the process at the start of this section, as a kill would",
    )
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    cfg = TINY if args.dry_run else FULL
    t0 = time.perf_counter()
    report = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(device),
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "goals": {},
        "errors": {},
    }
    state: dict = {}
    work = {
        "copy_bandwidth": lambda: state.setdefault("bw", copy_bandwidth(device, cfg["reps"])),
        "correctness_gae": lambda: check_gae(cfg, device),
        "correctness_logprobs": lambda: check_logprobs(cfg, device),
        "timings_gae": lambda: time_gae(cfg, device, state["bw"]),
        "timings_logprobs": lambda: time_logprobs(cfg, device),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for name in SECTIONS:
            try:
                if name == args.kill_section:
                    os._exit(3)
                if name == args.fail_section:
                    raise RuntimeError(f"--fail-section {name}")
                report[name] = work[name]()
            except Exception as exc:  # report it, keep the others' figures, go on
                report[name] = None
                report["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            # a kernel that failed to build here ran the chunked path instead: say so
            report["fallbacks"] = sorted({str(w.message) for w in caught
                                          if str(w.message).startswith("rlops:")})  # fmt: skip
            report["seconds"] = time.perf_counter() - t0
            _write(args.json, report)
    report["verdict"] = verdict(report)
    _write(args.json, report)
    print("\n".join(report["verdict"]))
    print(f"wrote {args.json} ({report['seconds']:.0f} s)")
    correct = all(r["pass"] for k in ("correctness_gae", "correctness_logprobs")
                  for r in report.get(k) or [])  # fmt: skip
    ok = correct and not report["fallbacks"] and not report["errors"]
    return 0 if ok else 1


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:
        return None


def _write(path, report):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a report


if __name__ == "__main__":
    sys.exit(main())
