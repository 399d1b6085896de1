"""The prepared GPU check: everything docs/gpu.md promises, measured in one process, sized to
fit a 10-minute device run.

    PYTHONPATH=src python benchmarks/gpu.py       # on a CUDA device (no install, no extras)
    python benchmarks/gpu.py --dry-run            # the same script on CPU under the Triton
                                                  # interpreter, at tiny shapes (CI)

The report goes to ``--json`` (default ``$OUT/gpu.json`` when ``OUT`` is set, else
``gpu.json``) and is written again after every section, each run under its own ``try``: a
Triton error or running out of memory in one section leaves the figures of the others.
Sections, in order (:data:`SECTIONS`):

* ``copy_bandwidth``: bytes per second of a 1 GiB device copy (read + write), the yardstick of
  the bandwidth figures.
* ``correctness_gae``, ``correctness_logprobs``: errors against float64, the rule of
  ``tests/tolerances.py`` (at most twice the float32 yardstick's error plus a few ulps of the
  output's magnitude). GAE with a mask and dones at 8 x 131072 and 256 x 8192, float32: Triton
  and the chunked path against a float64 oracle (the chunked path run in float64); the
  yardstick is the serial float32 reference where it is affordable (256 x 8192), else the
  chunked float32 path. Log-prob + entropy, forward and backward, at N = 32768, V = 151936 in
  float32 and bfloat16: Triton and the chunked path against the unfused reference in float64,
  row block by row block (the float32 reference is the yardstick).
* ``host_syncs``: each public call of the two families (Triton and chunked; the log-prob ops
  forward and backward), after a warm-up, under ``torch.cuda.set_sync_debug_mode("warn")``
  (every synchronising operation counted) and again under ``"error"`` (the call must finish).
  docs/gpu.md and DESIGN §14: none may stop the host.
* ``batch_invariance``: a row's bits alone (B = 1), in a batch of 3 (another order), of 64 and
  of 256: the scan family (GAE with a mask, dones, a bootstrap and truncation; returns;
  REINFORCE++; ``discounted_cumsum`` and its gradient) at T = 8192, where a block chosen from
  the number of rows would differ, and padded to the right with mask 0; the log-prob ops
  (log-prob, entropy, gradient) at V = 151936, bfloat16. Bitwise, or the largest difference.
* ``timings_gae``: GAE and the bare scan at 256 x 131072 and 8 x 131072 float32 — Triton, the
  chunked path, the chunk loop trainers ship (a C x C decay matmul per chunk, carries passed by
  a Python loop over chunks), torchrl's vectorised GAE when installed — as effective bandwidth
  (the bytes a single pass must move) over the copy's; and at 256 x 131072 the kernels with
  1024-step blocks (``block_t=1024``, the block a size chosen from the batch gave there), the
  cost of batch invariance.
* ``timings_logprobs``: log-prob + entropy forward + backward at N = 32768, V = 151936 bfloat16:
  Triton against ``log_softmax`` + gather (and with the entropy), against Liger's cross entropy
  when installed; the peak memory beyond the inputs and their gradient (``x.grad``, N·V, which
  every path allocates), from ``torch.cuda.max_memory_allocated``, for every side.

Timings: the variants compared are interleaved (one window of each in turn, per repeat), each
window one pair of CUDA events around many back-to-back calls (enough for ~20 ms of device
work), so the host's dispatch of a call overlaps the device's work on the previous ones; the
median window per variant.

Writes one JSON file and prints a short verdict; exits 1 when a correctness case, a batch
invariance case or a section failed, or a kernel fell back to the chunked path. Goals
(``docs/gpu.md``, reported, not the exit status): the scan at >= 50% of copy bandwidth at
256 x 131072; the fused log-prob forward + backward at <= 1.2x the time of ``log_softmax`` +
gather with <= 0.1x its extra memory at N = 32768, V = 151936, bfloat16; no host
synchronisation in any call.
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
from rlops.advantages.returns import GaeInputs  # noqa: E402
from rlops.advantages.triton import gae_triton  # noqa: E402
from rlops.logprobs.reference import logprobs_and_entropy_reference  # noqa: E402
from rlops.measure.baselines import gae_chunk_loop  # noqa: E402
from rlops.scan.triton import reverse_scan  # noqa: E402

FLOOR_ULPS = 4
SCAN = "triton scan (discounted_cumsum)"

FULL = {
    "gae_cases": [(8, 131072), (256, 8192)],
    "serial_max_t": 8192,
    "lp_case": (32768, 151936),
    "lp_rows": 2048,
    "gae_time": [(256, 131072), (8, 131072)],
    "lp_time": (32768, 151936),
    "sync_scan": (64, 8192),
    "sync_lp": (1024, 151936),
    "inv_batches": (1, 3, 64, 256),
    "inv_rows": (0, 37, 63),
    "inv_t": 8192,
    "inv_pad": 1000,
    "inv_v": 151936,
    "reps": 5,
}
TINY = {
    "gae_cases": [(2, 200), (3, 129)],
    "serial_max_t": 8192,
    "lp_case": (12, 300),
    "lp_rows": 5,
    "gae_time": [(2, 256), (1, 300)],
    "lp_time": (8, 300),
    "sync_scan": (2, 300),
    "sync_lp": (4, 300),
    "inv_batches": (1, 3, 8),
    "inv_rows": (0, 5, 7),
    "inv_t": 600,
    "inv_pad": 100,
    "inv_v": 300,
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


def _calls_per_window(fn, device):
    """How many back-to-back calls of ``fn()`` fill ~20 ms of device time (1 on CPU)."""
    if device.type != "cuda":
        return 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return max(1, min(200, int(WINDOW_S / max(start.elapsed_time(end) / 1e3, 1e-6))))


def _window(fn, calls, device):
    """Seconds per call over one window of ``calls`` back-to-back calls."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / calls


def timed_many(fns, device, reps):
    """Median seconds per call of each ``fns[name]()``, the variants interleaved: after a
    warm-up of each, ``reps`` rounds of one window per variant in turn (as many calls as fill
    ~20 ms, between one pair of CUDA events), so a neighbour's load on a shared device falls on
    every variant alike. A variant that raises (its warm-up or a window) gets its error
    instead of a time; the others go on. On CPU (the dry run) one call per window."""
    out, live = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            sync(device)
            live[name] = (fn, _calls_per_window(fn, device))
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            out[name] = exc
            _free(device)
    times: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(reps):
        for name, (fn, calls) in list(live.items()):
            try:
                times[name].append(_window(fn, calls, device))
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                out[name] = exc
                del live[name]
                _free(device)
    for name in live:
        out[name] = statistics.median(times[name])
    return {name: out[name] for name in fns}


def timed(fn, device, reps):
    """Median seconds per call of ``fn()`` (:func:`timed_many` of one variant)."""
    sec = timed_many({"fn": fn}, device, reps)["fn"]
    if isinstance(sec, BaseException):
        raise sec
    return sec


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(exc):
    return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


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


# ------------------------------------------------------------------ host synchronisation
SYNC_WARNING = "synchronizing"  # torch's warning under set_sync_debug_mode("warn")


def host_syncs(cfg, device):
    """Each public call of the two families (Triton and chunked), after a warm-up that builds
    its kernels: the synchronising operations it makes, counted under
    ``torch.cuda.set_sync_debug_mode("warn")``, and whether it finishes under ``"error"``.
    On CPU (the dry run) the calls run and nothing is counted."""
    b, t = cfg["sync_scan"]
    n, v = cfg["sync_lp"]
    gen = torch.Generator(device=device).manual_seed(4)
    r, val, mask, dones = gae_inputs(b, t, device, seed=4)
    boot = torch.randn(b, t, generator=gen, device=device)
    trunc = dones & (torch.rand(b, t, generator=gen, device=device) < 0.5)
    decay = 0.99 * (1 - 0.1 * torch.rand(b, t, generator=gen, device=device))
    outcome = torch.randn(b, generator=gen, device=device)
    logits = (3 * torch.randn(n, v, generator=gen, device=device)).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    g = torch.randn(n, generator=gen, device=device)

    def calls(method):
        def scan():
            x = r.detach().requires_grad_()
            rlops.discounted_cumsum(x, decay, method=method).backward(val)

        def lp():
            x = logits.detach().requires_grad_()
            lp, ent = rlops.logprobs_and_entropy(x, target, method=method)
            torch.autograd.backward([lp, ent], [g, g])

        kw = dict(mask=mask, dones=dones, method=method)
        return {
            "discounted_cumsum per-token fwd+bwd": scan,
            "gae mask+dones+bootstrap+truncated": lambda: rlops.gae(
                r, val, gamma=0.99, lam=0.95, bootstrap=boot, truncated=trunc, **kw
            ),
            "discounted_returns mask+dones": lambda: rlops.discounted_returns(r, gamma=0.99, **kw),
            "reinforce_plus_plus_returns": lambda: rlops.reinforce_plus_plus_returns(
                outcome, r, mask, kl_coef=0.05, gamma=0.99, method=method
            ),
            f"logprobs_and_entropy V={v} bfloat16 fwd+bwd": lp,
        }

    out = {}
    for method in ("triton", "chunked"):
        for name, fn in calls(method).items():
            out[f"{name} {method}"] = _count_syncs(fn, device)
    return out


def _count_syncs(fn, device):
    try:
        fn()  # builds the kernels: a first launch may wait for the compiler, not the device
        sync(device)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        _free(device)
        return _error(exc)
    if device.type != "cuda":
        return {"syncs": None, "error_mode_ok": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
    for w in caught:  # the others (a kernel set aside) go on to the report's record
        if SYNC_WARNING not in str(w.message):
            warnings.warn(w.message, w.category, stacklevel=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        raised = None
    except RuntimeError as exc:
        raised = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return {"syncs": len(found), "first": found[0][:200] if found else None,
            "error_mode_ok": raised is None, "error_mode": raised}  # fmt: skip


# ------------------------------------------------------------------ batch invariance
def batch_invariance(cfg, device):
    """A row's bits alone, in a batch of 3 (another order) and in the first 64 and 256 rows,
    for the scan family (and, for its forward passes, padded to the right) and the log-prob
    ops: per case the largest difference from the row alone, and whether all are bitwise."""
    nmax, t, pad = max(cfg["inv_batches"]), cfg["inv_t"], cfg["inv_pad"]
    gen = torch.Generator(device=device).manual_seed(5)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    tt = t + pad  # inputs past T: the padding (its values replaced where they would count)
    u = rand(nmax, tt)
    decay = torch.where(u < 0.1, rand(nmax, tt), torch.full_like(u, 0.97))
    dones = rand(nmax, tt) < 0.005
    data = {
        "x": randn(nmax, tt),
        "a_row": 0.9 + 0.1 * rand(nmax, 1),
        "a_tok": torch.where(u < 0.01, 0.0, decay),  # exact cuts
        "g": randn(nmax, tt),
        "r": randn(nmax, tt),
        "v": randn(nmax, tt),
        "mask": rand(nmax, tt) < 0.8,
        "dones": dones,
        "truncated": dones & (rand(nmax, tt) < 0.5),
        "boot": randn(nmax, tt),
        "boot_row": randn(nmax),
        "outcome": randn(nmax),
    }
    out = {}
    for name, (fn, padding) in _SCAN_FAMILY.items():
        out[name] = _invariance(fn, data, t, cfg, padding)
    v = cfg["inv_v"]
    logits = (3 * randn(nmax, v)).to(torch.bfloat16)
    lp_data = {"logits": logits, "target": torch.randint(0, v, (nmax,), generator=gen,
               device=device), "g_lp": randn(nmax), "g_ent": randn(nmax)}  # fmt: skip
    out[f"logprobs_and_entropy V={v} bfloat16 fwd+bwd triton"] = _invariance(
        _lp_rows, lp_data, None, cfg, None
    )
    return out


def _at(d, rows, t=None):
    """The inputs of ``rows``, their time axis cut to ``t``."""
    out = {}
    for k, x in d.items():
        x = x[rows]
        out[k] = x[:, :t] if t is not None and x.dim() == 2 and x.shape[1] > t else x
    return out


def _invariance(fn, data, t, cfg, padding):
    picks = list(cfg["inv_rows"])
    alone = [fn(_at(data, [i], t)) for i in picks]
    diffs = {}
    for b in cfg["inv_batches"]:
        if b == 1:
            continue
        rows = picks[::-1] if b == len(picks) else list(range(b))
        got = fn(_at(data, rows, t))
        diffs[f"B={b}"] = max(
            _diff([o[rows.index(i) : rows.index(i) + 1] for o in got], want)
            for i, want in zip(picks, alone, strict=True)
        )
    if padding is not None:
        padded = {k: x.clone() for k, x in _at(data, picks).items()}
        for k, value in padding.items():
            padded[k][:, t:] = value
        got = fn(padded)
        diffs["padded"] = max(
            _diff([o[j : j + 1, :t] for o in got], want) for j, want in enumerate(alone)
        )
    return {"max_abs_diff": diffs, "bitwise": all(d == 0.0 for d in diffs.values())}


def _diff(got, want):
    """The largest difference of outputs; 0 where they are equal as ``torch.equal`` has it (a
    zero of either sign), NaN matching NaN."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            return float("inf")
        same = (g == w) | (g.isnan() & w.isnan())
        if not bool(same.all()):
            worst = max(worst, float((g.double() - w.double()).abs().nan_to_num(float("inf"))
                                     .max()))  # fmt: skip
            worst = worst or float("inf")
    return worst


def _scan_rows(d):
    x = d["x"].clone().requires_grad_()
    a = d["a_tok"].clone().requires_grad_()
    y = rlops.discounted_cumsum(x, a, method="triton")
    y.backward(d["g"])
    return y.detach(), x.grad, a.grad


_SCAN_FAMILY = {
    "discounted_cumsum per-row decay triton": (
        lambda d: (rlops.discounted_cumsum(d["x"], d["a_row"], method="triton"),),
        {"x": 0.0},
    ),
    "discounted_cumsum per-token decay fwd+bwd triton": (_scan_rows, None),
    "gae mask+dones+bootstrap+truncated triton": (
        lambda d: rlops.gae(d["r"], d["v"], gamma=0.99, lam=0.95, mask=d["mask"],
                            dones=d["dones"], bootstrap=d["boot"], truncated=d["truncated"],
                            method="triton"),
        {"mask": False, "dones": False, "truncated": False},
    ),
    "discounted_returns mask+dones+bootstrap triton": (
        lambda d: (rlops.discounted_returns(d["r"], gamma=0.99, mask=d["mask"],
                                            dones=d["dones"], bootstrap=d["boot_row"],
                                            method="triton"),),
        {"mask": False, "dones": False},
    ),
    "reinforce_plus_plus_returns triton": (
        lambda d: (rlops.reinforce_plus_plus_returns(d["outcome"], d["r"], d["mask"],
                                                     kl_coef=0.05, gamma=0.99, method="triton"),),
        {"mask": False},
    ),
}  # fmt: skip


def _lp_rows(d):
    x = d["logits"].detach().requires_grad_()
    lp, ent = lp_triton(x, d["target"])
    torch.autograd.backward([lp, ent], [d["g_lp"], d["g_ent"]])
    return lp.detach(), ent.detach(), x.grad


# ------------------------------------------------------------------ timings
def time_gae(cfg, device, copy_bw):
    """GAE and the bare scan at each shape of ``cfg["gae_time"]``, the variants interleaved, as
    effective bandwidth over the copy's; at the first shape the kernels with 1024-step blocks
    too (the cost of a block that does not follow the batch)."""
    out = {}
    for k, (b, t) in enumerate(cfg["gae_time"]):
        out[f"{b}x{t}"] = _time_gae_shape(b, t, cfg["reps"], device, copy_bw, big_blocks=k == 0)
        _free(device)
    return out


def _time_gae_shape(b, t, reps, device, copy_bw, big_blocks):
    r, v, _, _ = gae_inputs(b, t, device, seed=2)
    gamma, lam = 0.999, 0.95
    g = torch.full((b,), gamma, device=device)
    plain = GaeInputs(r, v, None, None, g, torch.full((b,), gamma * lam, device=device))
    gae_bytes = 4 * r.numel() * 4  # read r, v; write advantages, returns (float32)
    scan_bytes = 2 * r.numel() * 4  # read x, write y
    variants = {
        "triton": (lambda: gae_triton(plain), gae_bytes),
        "chunked": (lambda: rlops.gae(r, v, gamma=gamma, lam=lam, method="chunked"), gae_bytes),
        "chunk loop (trainers')": (lambda: gae_chunk_loop(r, v, gamma, lam), gae_bytes),
        SCAN: (lambda: reverse_scan(r, gamma * lam), scan_bytes),
    }
    trl = torchrl_gae()
    if trl is not None:
        variants["torchrl vectorised"] = (lambda: trl(r, v, gamma, lam), gae_bytes)
    if big_blocks:
        variants["triton block_t=1024"] = (lambda: gae_triton(plain, block_t=1024), gae_bytes)
        variants[f"{SCAN} block_t=1024"] = (
            lambda: reverse_scan(r, gamma * lam, block_t=1024),
            scan_bytes,
        )
    secs = timed_many({name: fn for name, (fn, _) in variants.items()}, device, reps)
    rows = {}
    for name, sec in secs.items():
        if isinstance(sec, BaseException):
            rows[name] = _error(sec)
        else:
            frac = variants[name][1] / sec / copy_bw
            rows[name] = {"seconds": sec, "fraction_of_copy_bandwidth": frac}
    for name in ("triton", SCAN):
        big, base = rows.get(f"{name} block_t=1024", {}), rows.get(name, {})
        if "seconds" in big and "seconds" in base:
            base["time_over_1024_step_blocks"] = base["seconds"] / big["seconds"]
    return rows


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
    steps = {}
    for name, (fn, two) in variants.items():

        def step(fn=fn, two=two):
            x = logits.detach().requires_grad_()
            res = fn(x, target)
            if two:
                torch.autograd.backward(list(res), [g, g])
            else:
                res.backward(g)
            return x.grad

        steps[name] = step
    grad_bytes = logits.numel() * logits.element_size()  # x.grad: every path's
    out = {}
    for name, sec in timed_many(steps, device, reps).items():
        if isinstance(sec, BaseException):
            out[name] = _error(sec)
            continue
        try:
            extra = peak_extra(steps[name], device, beyond=grad_bytes)
            out[name] = {"seconds": sec, "peak_extra_bytes": extra}
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            out[name] = {"seconds": sec, **_error(exc)}
        _free(device)
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
    inv = report.get("batch_invariance") or {}
    varying = {k: r["max_abs_diff"] for k, r in inv.items() if not r.get("bitwise", False)}
    if inv:
        lines.append("batch invariance: bitwise in every case" if not varying
                     else f"BATCH-DEPENDENT BITS: {varying}")  # fmt: skip
    syncs = report.get("host_syncs") or {}
    counted = {k: r for k, r in syncs.items() if r.get("syncs") is not None}
    stopping = {k: r["syncs"] for k, r in counted.items()
                if r["syncs"] or not r["error_mode_ok"]}  # fmt: skip
    if counted:
        lines.append("host syncs: none in any call" if not stopping
                     else f"HOST SYNCS per call: {stopping}")  # fmt: skip
    gae_shapes = report.get("timings_gae") or {}
    for shape, rows in gae_shapes.items():
        for name, row in rows.items():
            if "fraction_of_copy_bandwidth" in row:
                ms, frac = row["seconds"] * 1e3, row["fraction_of_copy_bandwidth"]
                lines.append(f"{shape} {name}: {ms:.3f} ms, {frac:.1%} of copy bandwidth")
            if "time_over_1024_step_blocks" in row:
                lines.append(f"{shape} {name}: {row['time_over_1024_step_blocks']:.2f}x the "
                             "time with 1024-step blocks")  # fmt: skip
    lp = report.get("timings_logprobs") or {}
    base, fused = lp.get("log_softmax + gather", {}), lp.get("triton logp + entropy", {})
    t_ratio = _ratio(fused, base, "seconds")
    m_ratio = _ratio(fused, base, "peak_extra_bytes")
    goals = report["goals"]
    first = next(iter(gae_shapes.values()), {})
    scan = first.get(SCAN, {}).get("fraction_of_copy_bandwidth")
    goals["scan >= 50% of copy bandwidth"] = None if scan is None else bool(scan >= 0.5)
    goals["fused fwd+bwd <= 1.2x log_softmax + gather"] = (
        None if t_ratio is None else bool(t_ratio <= 1.2)
    )
    goals["fused extra memory <= 0.1x log_softmax + gather"] = (
        None if m_ratio is None else bool(m_ratio <= 0.1)
    )
    goals["no host sync in any call"] = None if not counted else not stopping
    if t_ratio is not None:
        lines.append(
            f"triton logp + entropy / log_softmax + gather: time {t_ratio:.2f}x"
            + ("" if m_ratio is None else f", extra memory {m_ratio:.3f}x")
        )
    lines.append("goals: " + ", ".join(f"{k}: {v}" for k, v in goals.items()))
    if report["dry_run"]:
        lines.append("(dry run: CPU, Triton interpreter, tiny shapes; timings mean nothing)")
    return lines


SECTIONS = ("copy_bandwidth", "correctness_gae", "correctness_logprobs", "host_syncs",
            "batch_invariance", "timings_gae", "timings_logprobs")  # fmt: skip


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
        "section_seconds": {},
    }
    state: dict = {}
    work = {
        "copy_bandwidth": lambda: state.setdefault("bw", copy_bandwidth(device, cfg["reps"])),
        "correctness_gae": lambda: check_gae(cfg, device),
        "correctness_logprobs": lambda: check_logprobs(cfg, device),
        "host_syncs": lambda: host_syncs(cfg, device),
        "batch_invariance": lambda: batch_invariance(cfg, device),
        "timings_gae": lambda: time_gae(cfg, device, state["bw"]),
        "timings_logprobs": lambda: time_logprobs(cfg, device),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for name in SECTIONS:
            start = time.perf_counter()
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
            report["section_seconds"][name] = time.perf_counter() - start
            report["seconds"] = time.perf_counter() - t0
            _write(args.json, report)
    report["verdict"] = verdict(report)
    _write(args.json, report)
    print("\n".join(report["verdict"]))
    print(f"wrote {args.json} ({report['seconds']:.0f} s)")
    correct = all(r["pass"] for k in ("correctness_gae", "correctness_logprobs")
                  for r in report.get(k) or [])  # fmt: skip
    invariant = all(r.get("bitwise", False) for r in (report.get("batch_invariance") or {})
                    .values())  # fmt: skip
    ok = correct and invariant and not report["fallbacks"] and not report["errors"]
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
