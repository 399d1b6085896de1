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

Slow baselines are timed at a short length and extrapolated (linear in T) when the full
length would take more than ``SLOW_LIMIT_S``; such rows are marked ``extrapolated``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import rlops
from rlops.cli import baselines
from rlops.cli.measure import PeakMemory, measure_in_fresh_process, sync, time_median
from rlops.cli.workloads import setup_linear, setup_logits

__all__ = ["SLOW_LIMIT_S", "Row", "bench_advantages", "bench_group", "bench_logprobs"]

SLOW_LIMIT_S = 10.0


@dataclasses.dataclass
class Row:
    section: str  # "advantages", "group", "logprobs"
    case: str  # "gae", "reinforce++ returns", "grpo", "log-prob + entropy", ...
    size: int  # T (or tokens for logprobs)
    shape: str
    method: str
    seconds: float
    ours: bool = False
    extrapolated: bool = False
    peak_bytes: int | None = None


def _time_or_extrapolate(
    make: Callable[[int], tuple], fn: Callable, t_len: int, device, repeats: int
) -> tuple[float, bool]:
    """Time a baseline linear in T; extrapolate from a shorter T when it would take too long."""
    probe = min(t_len, 1024)
    args = make(probe)
    t_probe = time_median(lambda: fn(*args), device, repeats=1, warmup=0)
    if probe == t_len:
        return time_median(lambda: fn(*args), device, repeats=repeats, budget_s=2.0), False
    estimate = t_probe * t_len / probe
    if estimate > SLOW_LIMIT_S:
        return estimate, True
    args = make(t_len)
    if estimate > 1.0:  # one run is enough for a baseline this slow (the probe warmed it up)
        return time_median(lambda: fn(*args), device, repeats=1, warmup=0), False
    return time_median(lambda: fn(*args), device, repeats=max(1, min(repeats, 3))), False


def _ours(fn: Callable, device, repeats: int) -> tuple[float, int | None]:
    seconds = time_median(fn, device, repeats=repeats)
    with PeakMemory(device) as peak:
        out = fn()
        sync(device)
    del out
    return seconds, peak.bytes


def bench_advantages(
    batch: int,
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    gamma: float = 1.0,
    lam: float = 0.95,
    repeats: int = 10,
    progress: Callable[[], None] | None = None,
) -> list[Row]:
    """GAE and REINFORCE++ returns at ``[batch, T]`` for each T, every method side by side."""
    device = torch.device(device)
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

    def row(t_len, case, method, seconds, ours=False, extra=False, peak=None):
        shape = f"{batch}x{t_len}"
        rows.append(Row("advantages", case, t_len, shape, method, seconds, ours, extra, peak))

    def token_rewards(kl):
        tr = -0.1 * kl
        tr[:, -1] += 1.0
        return tr

    # rlops and the floor first, for every length: the slow baselines below leave the heap
    # fragmented by millions of tiny tensors, which would slow every later allocation
    for t_len, (r, v, kl) in data.items():
        for method in ("chunked", "auto"):
            s, peak = _ours(
                lambda m=method, r=r, v=v: rlops.gae(r, v, gamma=gamma, lam=lam, method=m),
                device,
                repeats,
            )
            row(t_len, "gae", f"rlops {method}", s, ours=method == "auto", peak=peak)
        s = time_median(lambda r=r, v=v: (torch.add(r, v), r.clone()), device, repeats=repeats)
        row(t_len, "gae", "memory floor", s)
        mask = torch.ones(batch, t_len, dtype=torch.bool, device=device)
        s, peak = _ours(
            lambda kl=kl, mask=mask: rlops.reinforce_plus_plus_returns(
                outcome, kl, mask, kl_coef=0.1, gamma=gamma
            ),
            device,
            repeats,
        )
        row(t_len, "reinforce++ returns", "rlops auto", s, ours=True, peak=peak)
    for t_len in seq_lens:
        s, x = _time_or_extrapolate(
            make, lambda a, b: baselines.gae_chunk_loop(a, b, gamma, lam), t_len, device, repeats
        )
        row(t_len, "gae", "chunk loop (C=256)", s, extra=x)
        s, x = _time_or_extrapolate(
            make_returns,
            lambda kl: baselines.gae_chunk_loop(token_rewards(kl), torch.zeros_like(kl), gamma, 1),
            t_len,
            device,
            repeats,
        )
        row(t_len, "reinforce++ returns", "chunk loop (C=256)", s, extra=x)
        s, x = _time_or_extrapolate(
            make, lambda a, b: baselines.gae_token_loop(a, b, gamma, lam), t_len, device, repeats
        )
        row(t_len, "gae", "per-token loop", s, extra=x)
        s, x = _time_or_extrapolate(
            make_returns,
            lambda kl: baselines.returns_token_loop(list(token_rewards(kl)), gamma),
            t_len,
            device,
            repeats,
        )
        row(t_len, "reinforce++ returns", "per-sample token loop", s, extra=x)
        if progress is not None:
            progress()
    order = [
        "per-token loop",
        "per-sample token loop",
        "chunk loop (C=256)",
        "rlops chunked",
        "rlops auto",
        "memory floor",
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
) -> list[Row]:
    """GRPO and RLOO at ``[group_batch, t_len]`` (bool mask, arbitrary group ids)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    b = group_batch
    scores = torch.randint(0, 2, (b,), generator=gen).float().to(device)
    index = (torch.randperm(b, generator=gen) // group_size * 7919).to(device)
    lengths = torch.randint(1, t_len + 1, (b, 1), generator=gen).to(device)
    mask = torch.arange(t_len, device=device) < lengths
    ids = index.tolist()
    fmask = mask.float()
    shape = f"{b}x{t_len}"
    rows = []
    for case, ours, kind in (
        ("grpo", rlops.grpo_advantages, "grpo"),
        ("rloo", rlops.rloo_advantages, "rloo"),
    ):
        s = time_median(
            lambda k=kind: baselines.group_loop(scores, ids, fmask, k), device, repeats=repeats
        )
        rows.append(Row("group", case, t_len, shape, "per-sample loop", s))
        s, peak = _ours(lambda f=ours: f(scores, index, mask), device, repeats)
        rows.append(Row("group", case, t_len, shape, "rlops", s, True, False, peak))
    return rows


def _measure_step(
    setup: Callable, kwargs: dict, prime: dict, device: torch.device, repeats: int
) -> tuple[float, int | None]:
    """Median seconds and peak extra bytes of ``setup(**kwargs)``'s step: on CPU in a fresh
    process (after the tiny ``prime`` instance), on CUDA here with the allocator's peak."""
    if device.type == "cuda":
        step = setup(**kwargs, device=str(device))
        step()
        seconds = time_median(step, device, repeats=5)
        with PeakMemory(device) as peak:
            step()
        return seconds, peak.bytes
    m = measure_in_fresh_process(
        setup,
        kwargs,
        prime_kwargs=prime,
        threads=torch.get_num_threads(),
        repeats=repeats,
    )
    return m["time_s"], int(m["peak_extra_bytes"])


def bench_logprobs(
    token_counts: list[int],
    vocab: int,
    *,
    hidden: int = 512,
    top_p: float = 0.9,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    progress: Callable[[], None] | None = None,
) -> list[Row]:
    """Log-prob + entropy, forward + backward with random upstream gradients, time and peak
    extra memory (CPU: each variant in a fresh process), for each token count N:

    * over ``[N, vocab]`` fp32 logits: unfused (``log_softmax``) vs rlops fused;
    * from ``[N, hidden]`` hidden states and a ``[vocab, hidden]`` output weight: the logits
      materialised then rlops fused vs rlops fused linear (no ``[N, vocab]`` logits);
    * the same with a top-p sampler's support replayed: materialised logits and a full
      ``[N, vocab]`` keep mask (sort, cumsum, scatter) vs rlops fused linear with ``top_p``.
    """
    device = torch.device(device)
    rows = []
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
                seconds, peak = _measure_step(
                    setup, {**kwargs, **kw}, {**prime, **kw}, device, repeats
                )
                ours = kw["fused"]
                rows.append(Row("logprobs", case, n, shape, label, seconds, ours, False, peak))
        if progress is not None:
            progress()
    return rows
