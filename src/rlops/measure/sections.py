"""The sections ``rlops bench`` measures: rlops against the implementations it replaces.

Each section is a list of :class:`Row`, measured side by side in one run:

* ``advantages``: for each T, GAE (per-token loop, chunk loop, rlops chunked / auto, and the
  memory floor: one add plus one copy over the bytes GAE must read and write) and REINFORCE++
  returns (per-sample token loop, chunk loop, rlops), on ``[B, T]``.
* ``group``: GRPO and RLOO advantages at ``[group_batch, T_min]`` against the per-sample loop.
* ``logprobs``: log-prob + entropy, forward and backward, time and peak extra memory, each in
  a fresh process (CPU) or with the CUDA allocator's peak: over logits, fused vs unfused
  (log_softmax + gather, softmax entropy); from the output layer's hidden states, materialised
  logits + fused vs the fused linear op; and with a top-p support, materialised logits + a
  full keep mask vs the fused linear op with ``top_p``.
* ``agentic``: the fused linear op as an agentic trainer calls it, forward and backward, time
  and peak extra memory: every row vs a row ``mask`` of a few valid rows; a dense ``[N, V]``
  ``keep_mask`` of a few kept ids per row vs the same sets as CSR (``support_ids``).

Every method is timed at each of :func:`thread_counts` (on CPU, 1 and the run's count): a
loop of small operations can stall at every intra-op join while another process holds a core.
A row's ``seconds`` is what the tables compare: a baseline's (and the floor's) faster time,
rlops' time at the run's count. Slow baselines are timed at a short length and extrapolated
(linear in T) when the full length would take more than ``slow_limit_s``; such rows are marked
``extrapolated``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import rlops
from rlops.measure import baselines
from rlops.measure.timing import (
    PeakMemory,
    measure_in_fresh_process,
    sync,
    time_by_threads,
    time_median,
    torch_threads,
)
from rlops.measure.workloads import setup_agentic, setup_linear, setup_logits

__all__ = [
    "FLOOR",
    "SLOW_LIMIT_S",
    "Row",
    "bench_advantages",
    "bench_agentic",
    "bench_group",
    "bench_logprobs",
    "thread_counts",
]

SLOW_LIMIT_S = 10.0
FLOOR = "memory floor"
Callback = Callable[[], None] | None


@dataclasses.dataclass
class Row:
    section: str  # "advantages", "group", "logprobs"
    case: str  # "gae", "reinforce++ returns", "grpo", "log-prob + entropy", ...
    size: int  # T (or tokens for logprobs)
    shape: str
    method: str
    seconds: float  # compared: a baseline's fastest over ``times``, rlops' at the run's count
    ours: bool = False
    extrapolated: bool = False
    peak_bytes: int | None = None
    times: dict[int, float] = dataclasses.field(default_factory=dict)  # seconds per threads
    unit_bytes: int | None = None  # bytes of one [B, T] tensor of the case (memory multiples)


def thread_counts(device: torch.device | str, threads: int | None = None) -> tuple[int, ...]:
    """The torch thread counts every method is timed at: ``(1, threads)`` on CPU (``threads``
    defaults to torch's count), ``(threads,)`` alone on CUDA or where ``threads`` is 1."""
    n = threads or torch.get_num_threads()
    return (n,) if torch.device(device).type == "cuda" or n == 1 else (1, n)


def _row(
    section: str, case: str, size: int, shape: str, method: str, times: dict, ours=False, **kw
) -> Row:
    seconds = times[max(times)] if ours else min(times.values())
    return Row(section, case, size, shape, method, seconds, ours, times=times, **kw)


def _time_or_extrapolate(
    make: Callable[[int], tuple],
    fn: Callable,
    t_len: int,
    device,
    repeats: int,
    counts: tuple[int, ...],
    slow_limit_s: float,
) -> tuple[dict[int, float], bool]:
    """Time a baseline linear in T at each thread count; extrapolate from a shorter T where
    the full length would take more than ``slow_limit_s``."""
    probe = min(t_len, 1024)
    args, full = make(probe), None
    times, extrapolated = {}, False
    for n in counts:
        with torch_threads(n):
            t_probe = time_median(lambda: fn(*args), device, repeats=1, warmup=0)
            estimate = t_probe * t_len / probe
            if probe == t_len:
                times[n] = time_median(lambda: fn(*args), device, repeats=repeats)
            elif estimate > slow_limit_s:
                times[n], extrapolated = estimate, True
            else:
                full = full or make(t_len)
                # one run is enough for a baseline this slow (the probe warmed it up)
                runs = 1 if estimate > 1.0 else max(1, min(repeats, 3))
                step = lambda full=full: fn(*full)  # noqa: E731
                times[n] = time_median(step, device, repeats=runs, warmup=min(runs - 1, 1))
    return times, extrapolated


def _ours(fn: Callable, device, repeats: int, counts) -> tuple[dict[int, float], int | None]:
    times = time_by_threads(fn, device, counts, repeats=repeats)
    with torch_threads(counts[-1]), PeakMemory(device) as peak:
        out = fn()
        sync(device)
    del out
    return times, peak.bytes


def bench_advantages(
    batch: int,
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    gamma: float = 1.0,
    lam: float = 0.95,
    repeats: int = 10,
    threads: int | None = None,
    slow_limit_s: float = SLOW_LIMIT_S,
    progress: Callback = None,
) -> list[Row]:
    """GAE and REINFORCE++ returns at ``[batch, T]`` for each T, every method side by side;
    ``progress()`` after each T's baselines."""
    device = torch.device(device)
    counts = thread_counts(device, threads)
    rows: list[Row] = []
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(t_len: int):
        r = torch.randn(batch, t_len, generator=gen, dtype=dtype).to(device)
        v = torch.randn(batch, t_len, generator=gen, dtype=dtype).to(device)
        return r, v

    def make_returns(t_len: int):
        kl = torch.randn(batch, t_len, generator=gen, dtype=dtype).to(device) * 0.01
        return (kl,)

    r0, v0 = make(64)
    rlops.gae(r0, v0, gamma=gamma, lam=lam)  # compile / warm every path once
    rlops.reinforce_plus_plus_returns(r0[:, 0], r0, r0 > 0, kl_coef=0.1, gamma=gamma)
    outcome = torch.ones(batch, dtype=dtype, device=device)
    data = {t_len: (*make(t_len), *make_returns(t_len)) for t_len in seq_lens}
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def row(t_len, case, method, times, ours=False, extra=False, peak=None):
        shape, unit = f"{batch}x{t_len}", batch * t_len * itemsize
        kw = dict(extrapolated=extra, peak_bytes=peak, unit_bytes=unit)
        rows.append(_row("advantages", case, t_len, shape, method, times, ours, **kw))

    def token_rewards(kl):
        tr = -0.1 * kl
        tr[:, -1] += 1.0
        return tr

    # rlops and the floor first, for every length: the slow baselines below leave the heap
    # fragmented by millions of tiny tensors, which would slow every later allocation
    for t_len, (r, v, kl) in data.items():
        for method in ("chunked", "auto"):
            times, peak = _ours(
                lambda m=method, r=r, v=v: rlops.gae(r, v, gamma=gamma, lam=lam, method=m),
                device,
                repeats,
                counts,
            )
            row(t_len, "gae", f"rlops {method}", times, ours=method == "auto", peak=peak)
        floor = lambda r=r, v=v: (torch.add(r, v), r.clone())  # noqa: E731
        row(t_len, "gae", FLOOR, time_by_threads(floor, device, counts, repeats=repeats))
        mask = torch.ones(batch, t_len, dtype=torch.bool, device=device)
        times, peak = _ours(
            lambda kl=kl, mask=mask: rlops.reinforce_plus_plus_returns(
                outcome, kl, mask, kl_coef=0.1, gamma=gamma
            ),
            device,
            repeats,
            counts,
        )
        row(t_len, "reinforce++ returns", "rlops auto", times, ours=True, peak=peak)
    loops = (
        ("gae", "chunk loop (C=256)", make,
         lambda a, b: baselines.gae_chunk_loop(a, b, gamma, lam)),
        ("reinforce++ returns", "chunk loop (C=256)", make_returns,
         lambda kl: baselines.gae_chunk_loop(token_rewards(kl), torch.zeros_like(kl), gamma, 1)),
        ("gae", "per-token loop", make, lambda a, b: baselines.gae_token_loop(a, b, gamma, lam)),
        ("reinforce++ returns", "per-sample token loop", make_returns,
         lambda kl: baselines.returns_token_loop(list(token_rewards(kl)), gamma)),
    )  # fmt: skip
    for t_len in seq_lens:
        for case, method, inputs, fn in loops:
            times, x = _time_or_extrapolate(
                inputs, fn, t_len, device, repeats, counts, slow_limit_s
            )
            row(t_len, case, method, times, extra=x)
        if progress is not None:
            progress()
    order = [
        "per-token loop",
        "per-sample token loop",
        "chunk loop (C=256)",
        "rlops chunked",
        "rlops auto",
        FLOOR,
    ]
    rows.sort(key=lambda r: (seq_lens.index(r.size), r.case != "gae", order.index(r.method)))
    return rows


def bench_group(
    group_batch: int,
    t_len: int,
    *,
    group_size: int = 8,
    device: torch.device | str = "cpu",
    repeats: int = 10,
    threads: int | None = None,
) -> list[Row]:
    """GRPO and RLOO at ``[group_batch, t_len]`` (bool mask, arbitrary group ids)."""
    device = torch.device(device)
    counts = thread_counts(device, threads)
    gen = torch.Generator().manual_seed(0)
    b = group_batch
    scores = torch.randint(0, 2, (b,), generator=gen).float().to(device)
    index = (torch.randperm(b, generator=gen) // group_size * 7919).to(device)
    lengths = torch.randint(1, t_len + 1, (b, 1), generator=gen).to(device)
    mask = torch.arange(t_len, device=device) < lengths
    ids = index.tolist()
    fmask = mask.float()
    shape, unit = f"{b}x{t_len}", b * t_len * scores.element_size()
    rows = []
    for case, ours, kind in (
        ("grpo", rlops.grpo_advantages, "grpo"),
        ("rloo", rlops.rloo_advantages, "rloo"),
    ):
        loop = lambda k=kind: baselines.group_loop(scores, ids, fmask, k)  # noqa: E731
        times = time_by_threads(loop, device, counts, repeats=repeats)
        rows.append(_row("group", case, t_len, shape, "per-sample loop", times, unit_bytes=unit))
        times, peak = _ours(lambda f=ours: f(scores, index, mask), device, repeats, counts)
        kw = dict(peak_bytes=peak, unit_bytes=unit)
        rows.append(_row("group", case, t_len, shape, "rlops", times, True, **kw))
    return rows


def _measure_step(
    setup: Callable, kwargs: dict, prime: dict, device: torch.device, repeats: int, counts
) -> tuple[dict[int, float], int | None]:
    """Median seconds per thread count and peak extra bytes of ``setup(**kwargs)``'s step: on
    CPU in a fresh process (after the tiny ``prime`` instance; memory at the run's count), on
    CUDA here with the allocator's peak."""
    if device.type == "cuda":
        step = setup(**kwargs, device=str(device))
        step()
        times = time_by_threads(step, device, counts, repeats=5)
        with PeakMemory(device) as peak:
            step()
        return times, peak.bytes
    m = measure_in_fresh_process(
        setup, kwargs, prime_kwargs=prime, threads=counts[::-1], repeats=repeats
    )
    return m["time_s_by_threads"], int(m["peak_extra_bytes"])


def bench_logprobs(
    token_counts: list[int],
    vocab: int,
    *,
    hidden: int = 512,
    top_p: float = 0.9,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    threads: int | None = None,
    progress: Callback = None,
) -> list[Row]:
    """Log-prob + entropy, forward + backward with random upstream gradients, time and peak
    extra memory (CPU: each variant in a fresh process), for each token count N:

    * over ``[N, vocab]`` fp32 logits: unfused (``log_softmax``) vs rlops fused;
    * from ``[N, hidden]`` hidden states and a ``[vocab, hidden]`` output weight: the logits
      materialised then rlops fused vs rlops fused linear (no ``[N, vocab]`` logits);
    * the same with a top-p sampler's support replayed: materialised logits and a full
      ``[N, vocab]`` keep mask (sort, cumsum, scatter) vs rlops fused linear with ``top_p``.

    ``progress()`` after each of the three cases.
    """
    device = torch.device(device)
    counts = thread_counts(device, threads)
    rows = []
    cases: list[tuple[Any, ...]]
    linear_case = "output layer + log-prob + entropy"
    top_p_case = f"top-p {top_p} output layer"
    for n in token_counts:
        cases = [
            ("log-prob + entropy", f"{n}x{vocab}", setup_logits, {"t": n, "v": vocab},
             {"t": 8, "v": 64}, (("unfused (log_softmax)", {"fused": False}),
                                 ("rlops fused", {"fused": True}))),
            (linear_case, f"{n}x{vocab}, H={hidden}", setup_linear,
             {"n": n, "v": vocab, "h": hidden}, {"n": 8, "v": 64, "h": 8},
             (("materialised logits + rlops fused", {"fused": False}),
              ("rlops fused linear", {"fused": True}))),
            (top_p_case, f"{n}x{vocab}, H={hidden}", setup_linear,
             {"n": n, "v": vocab, "h": hidden}, {"n": 8, "v": 64, "h": 8},
             (("materialised + keep mask", {"fused": False, "top_p": top_p}),
              ("rlops fused linear top-p", {"fused": True, "top_p": top_p}))),
        ]  # fmt: skip
        for case, shape, setup, kwargs, prime, methods in cases:
            for label, kw in methods:
                times, peak = _measure_step(
                    setup, {**kwargs, **kw}, {**prime, **kw}, device, repeats, counts
                )
                ours = kw["fused"]
                rows.append(_row("logprobs", case, n, shape, label, times, ours, peak_bytes=peak))
            if progress is not None:
                progress()
    return rows


def bench_agentic(
    token_counts: list[int],
    vocab: int,
    *,
    hidden: int = 512,
    valid: float = 0.03,
    ids: int = 20,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    threads: int | None = None,
    progress: Callback = None,
) -> list[Row]:
    """The fused linear op at agentic shapes (:func:`rlops.measure.workloads.setup_agentic`),
    forward + backward, time and peak extra memory (CPU: each variant in a fresh process),
    for each token count N:

    * a fraction ``valid`` of the rows valid: every row computed vs ``mask=`` (the others cost
      nothing);
    * ``ids`` kept ids per row: a dense ``[N, vocab]`` ``keep_mask`` vs the CSR sets.

    ``progress()`` after each of the two cases.
    """
    device = torch.device(device)
    counts = thread_counts(device, threads)
    rows = []
    for n in token_counts:
        shape = f"{n}x{vocab}, H={hidden}"
        cases = [
            (f"agentic: {valid:.0%} valid rows", (("rlops fused linear, every row", "all"),
                                                  ("rlops fused linear, mask=", "mask"))),
            (f"agentic: {ids} kept ids per row", (("dense keep_mask", "dense"),
                                                  ("CSR support_ids", "csr"))),
        ]  # fmt: skip
        for case, methods in cases:
            for i, (label, form) in enumerate(methods):
                kw = {"n": n, "v": vocab, "h": hidden, "form": form, "valid": valid, "ids": ids}
                prime = {**kw, "n": 8, "v": 64, "h": 8, "ids": min(ids, 8)}
                times, peak = _measure_step(setup_agentic, kw, prime, device, repeats, counts)
                rows.append(_row("agentic", case, n, shape, label, times, i == 1, peak_bytes=peak))
            if progress is not None:
                progress()
    return rows
