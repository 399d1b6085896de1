"""The sections ``rlops bench`` measures: rlops against the implementations it replaces.

Each section is a list of :class:`Row`, measured side by side in one run:

* ``advantages``: for each T, GAE (per-token loop, chunk loop, rlops chunked / auto) and
  REINFORCE++ returns (per-sample token loop, chunk loop, rlops), on ``[B, T]``, each beside
  the memory floor, the allocating one: what any function returning new tensors pays,
  ``torch.add(r, v)`` and ``r.clone()`` (read two ``[B, T]`` inputs, write two new outputs),
  timed once for both tables.
* ``group``: GRPO and RLOO advantages at ``[group_batch, T_min]`` against the per-sample loop.
* ``logprobs``: log-prob + entropy, forward and backward, time and peak extra memory, each in
  a fresh process (CPU) or with the CUDA allocator's peak: over logits, fused vs unfused
  (log_softmax + gather, softmax entropy); from the output layer's hidden states, materialised
  logits + fused vs the fused linear op; and with a top-p support, materialised logits + a
  full keep mask vs the fused linear op with ``top_p``; a PPO step's loss phase.
* ``agentic``: the fused linear op as an agentic trainer calls it, forward and backward, time
  and peak extra memory: every row vs a row ``mask`` of a few valid rows; a dense ``[N, V]``
  ``keep_mask`` of a few kept ids per row vs the same sets as CSR (``support_ids``).
* ``distillation``: top-k forward-KL distillation from the output layer, forward and backward,
  time and peak extra memory, measured as log-probs: verl's default and chunked paths, the
  logits then ``distillation_loss``, ``linear_distillation_loss``; and with the tail.

The methods of a section (of a case, for log-probs) are timed interleaved
(:func:`~rlops.measure.timing.time_interleaved`): every repeat calls each of them once, in
turn, so load from other processes falls on all of them alike. Each is timed at each of
:func:`thread_counts` (on CPU, 1 and the run's count): a loop of small operations can stall at
every intra-op join while another process holds a core. A row's ``seconds`` is what the tables
compare: its time at its own faster count (``threads``), for rlops as for the baselines. Slow
baselines are timed at a short length and extrapolated (linear in T) when the full length would
take more than ``slow_limit_s``; such rows are marked ``extrapolated``. Fast methods
repeat for about ``BUDGET_S`` each (a median of many calls). Peak memory is measured
apart from the timing: in this process after it (advantages, group; CUDA), or for log-probs on
CPU in a fresh process per variant.
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
    Setup,
    peak_in_fresh_process,
    sync,
    time_in_fresh_process,
    time_interleaved,
    time_median,
    torch_threads,
)
from rlops.measure.workloads import (
    setup_agentic,
    setup_distillation,
    setup_linear,
    setup_logits,
    setup_policy_step,
)

__all__ = [
    "BUDGET_S",
    "FLOOR",
    "SLOW_LIMIT_S",
    "Row",
    "bench_advantages",
    "bench_agentic",
    "bench_distillation",
    "bench_group",
    "bench_logprobs",
    "thread_counts",
]

SLOW_LIMIT_S = 10.0
# Seconds of calls each method gets: a method of a few milliseconds repeats until then (up to
# 100 times, interleaved with the others), so a burst of load from another process moves a few
# of its calls, not its median; a method of seconds keeps its ``repeats``.
BUDGET_S = 1.0
FLOOR = "memory floor"
Callback = Callable[[], None] | None


@dataclasses.dataclass
class Row:
    section: str  # "advantages", "group", "logprobs", "agentic", "distillation"
    case: str  # "gae", "reinforce++ returns", "grpo", "log-prob + entropy", ...
    size: int  # T (or tokens for logprobs)
    shape: str
    method: str
    seconds: float  # compared: the fastest over ``times`` (each method at its own best count)
    ours: bool = False
    extrapolated: bool = False
    peak_bytes: int | None = None
    times: dict[int, float] = dataclasses.field(default_factory=dict)  # seconds per threads
    unit_bytes: int | None = None  # bytes of one [B, T] tensor of the case (memory multiples)
    threads: int | None = None  # the thread count ``seconds`` was timed at


def thread_counts(device: torch.device | str, threads: int | None = None) -> tuple[int, ...]:
    """The torch thread counts every method is timed at: ``(1, threads)`` on CPU (``threads``
    defaults to torch's count), ``(threads,)`` alone on CUDA or where ``threads`` is 1."""
    n = threads or torch.get_num_threads()
    return (n,) if torch.device(device).type == "cuda" or n == 1 else (1, n)


def _row(
    section: str, case: str, size: int, shape: str, method: str, times: dict, ours=False, **kw
) -> Row:
    """A row compared at its own fastest thread count."""
    best = min(times, key=times.__getitem__)
    return Row(
        section, case, size, shape, method, times[best], ours, times=times, threads=best, **kw
    )


def _peak(fn: Callable, device: torch.device, threads: int) -> int | None:
    """Peak extra bytes of one call of ``fn`` in this process, at ``threads`` torch threads."""
    with torch_threads(threads), PeakMemory(device) as peak:
        out = fn()
        sync(device)
    del out
    return peak.bytes


def _baseline_call(
    make: Callable[[int], tuple],
    fn: Callable,
    t_len: int,
    device: torch.device,
    counts: tuple[int, ...],
    repeats: int,
    slow_limit_s: float,
) -> tuple[Callable[[], object], int, int, float]:
    """How to time a baseline linear in T within the interleaved repeats: ``(call, repeats,
    warm-up calls, scale)``. One call at T = 1024 (at each count) estimates the full length;
    over ``slow_limit_s``, the call stays at T = 1024 and its times are scaled by T / 1024
    (extrapolated); over 1 s, the full length runs once."""
    probe = min(t_len, 1024)
    args = make(probe)
    if probe == t_len:
        return (lambda: fn(*args)), repeats, 1, 1.0
    t_probe = []
    for n in counts:
        with torch_threads(n):
            t_probe.append(time_median(lambda: fn(*args), device, repeats=1, warmup=0))
    estimate = min(t_probe) * t_len / probe
    if estimate > slow_limit_s:
        return (lambda: fn(*args)), repeats, 0, t_len / probe
    full = make(t_len)
    runs = 1 if estimate > 1.0 else max(1, min(repeats, 3))  # the probe warmed it up
    return (lambda: fn(*full)), runs, min(runs - 1, 1), 1.0


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
    """GAE and REINFORCE++ returns at ``[batch, T]`` for each T, every method of both timed
    interleaved; ``progress()`` after each T."""
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
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def token_rewards(kl):
        tr = -0.1 * kl
        tr[:, -1] += 1.0
        return tr

    loops = (
        ("gae", "chunk loop (C=256)", make,
         lambda a, b: baselines.gae_chunk_loop(a, b, gamma, lam)),
        ("reinforce++ returns", "chunk loop (C=256)", make_returns,
         lambda kl: baselines.gae_chunk_loop(token_rewards(kl), torch.zeros_like(kl), gamma, 1)),
        ("gae", "per-token loop", make, lambda a, b: baselines.gae_token_loop(a, b, gamma, lam)),
        ("reinforce++ returns", "per-sample token loop", make_returns,
         lambda kl: baselines.returns_token_loop(list(token_rewards(kl)), gamma)),
    )  # fmt: skip

    def ours(t_len: int) -> dict[tuple[str, str], Callable[[], object]]:
        r, v = make(t_len)
        (kl,) = make_returns(t_len)
        mask = torch.ones(batch, t_len, dtype=torch.bool, device=device)
        return {
            ("gae", "rlops chunked"): lambda: rlops.gae(r, v, gamma=gamma, lam=lam,
                                                        method="chunked"),
            ("gae", "rlops auto"): lambda: rlops.gae(r, v, gamma=gamma, lam=lam, method="auto"),
            ("gae", FLOOR): lambda: (torch.add(r, v), r.clone()),
            ("reinforce++ returns", "rlops auto"): lambda: rlops.reinforce_plus_plus_returns(
                outcome, kl, mask, kl_coef=0.1, gamma=gamma),
        }  # fmt: skip

    for t_len in seq_lens:
        fns = ours(t_len)
        runs = dict.fromkeys(fns, repeats)
        warm = dict.fromkeys(fns, 1)
        scale = dict.fromkeys(fns, 1.0)
        for case, method, inputs, fn in loops:
            key = (case, method)
            fns[key], runs[key], warm[key], scale[key] = _baseline_call(
                inputs, fn, t_len, device, counts, repeats, slow_limit_s
            )
        timed = time_interleaved(fns, device, counts, repeats=runs, warmup=warm, budget_s=BUDGET_S)
        shape, unit = f"{batch}x{t_len}", batch * t_len * itemsize
        for (case, method), times in timed.items():
            mine = method.startswith("rlops")
            rows.append(
                _row(
                    "advantages", case, t_len, shape, method,
                    {n: t * scale[case, method] for n, t in times.items()},
                    ours=method == "rlops auto",
                    extrapolated=scale[case, method] != 1.0,
                    peak_bytes=_peak(fns[case, method], device, counts[-1]) if mine else None,
                    unit_bytes=unit,
                )
            )  # fmt: skip
        floor = next(r for r in reversed(rows) if r.method == FLOOR)
        rows.append(dataclasses.replace(floor, case="reinforce++ returns"))  # the same timing
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
    """GRPO and RLOO at ``[group_batch, t_len]`` (bool mask, arbitrary group ids), the
    per-sample loop and rlops of both timed interleaved."""
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
    fns: dict[tuple[str, str], Callable[[], object]] = {
        ("grpo", "per-sample loop"): lambda: baselines.group_loop(scores, ids, fmask, "grpo"),
        ("grpo", "rlops"): lambda: rlops.grpo_advantages(scores, index, mask),
        ("rloo", "per-sample loop"): lambda: baselines.group_loop(scores, ids, fmask, "rloo"),
        ("rloo", "rlops"): lambda: rlops.rloo_advantages(scores, index, mask),
    }
    timed = time_interleaved(fns, device, counts, repeats=repeats, budget_s=BUDGET_S)
    rows = []
    for (case, method), times in timed.items():
        mine = method == "rlops"
        peak = _peak(fns[case, method], device, counts[-1]) if mine else None
        kw = dict(peak_bytes=peak, unit_bytes=unit)
        rows.append(_row("group", case, t_len, shape, method, times, mine, **kw))
    return rows


def _measure_case(
    variants: dict[str, Setup], device: torch.device, repeats: int, counts: tuple[int, ...]
) -> tuple[dict[str, dict[int, float]], dict[str, int | None]]:
    """``({label: {n: median seconds}}, {label: peak extra bytes})`` of the variants of one
    case, ``label: (setup, kwargs, prime_kwargs)``, timed interleaved. CPU: the times in one
    fresh process, the memory of each in a fresh process of its own (after its tiny prime
    instance, at the run's count). CUDA: here, the memory with the allocator's peak."""
    if device.type == "cuda":
        steps = {k: setup(**kw, device=str(device)) for k, (setup, kw, _) in variants.items()}
        times = time_interleaved(steps, device, counts, repeats=max(repeats, 5), budget_s=BUDGET_S)
        peaks = {}
        for label, step in steps.items():
            with PeakMemory(device) as peak:
                step()
            peaks[label] = peak.bytes
        return times, peaks
    peaks = {
        label: peak_in_fresh_process(setup, kw, prime_kwargs=prime, threads=counts[-1])
        for label, (setup, kw, prime) in variants.items()
    }
    return time_in_fresh_process(variants, counts, repeats=repeats, budget_s=BUDGET_S), peaks


def _case_rows(
    section: str, case: str, n: int, shape: str, variants: dict[str, Setup], ours: str, **kw
) -> list[Row]:
    """The rows of one case (``ours``: the label of rlops' variant); ``kw``: device, repeats
    and counts of :func:`_measure_case`."""
    times, peaks = _measure_case(variants, **kw)
    return [
        _row(section, case, n, shape, label, times[label], label == ours, peak_bytes=peaks[label])
        for label in variants
    ]


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
    """Log-prob + entropy, forward + backward with random upstream gradients, time (the two
    variants of a case interleaved) and peak extra memory, for each token count N:

    * over ``[N, vocab]`` fp32 logits: unfused (``log_softmax``) vs rlops fused;
    * from ``[N, hidden]`` hidden states and a ``[vocab, hidden]`` output weight: the logits
      materialised then rlops fused vs rlops fused linear (no ``[N, vocab]`` logits);
    * the same with a top-p sampler's support replayed: materialised logits and a full
      ``[N, vocab]`` keep mask (sort, cumsum, scatter) vs rlops fused linear with ``top_p``;
    * a PPO step's loss phase (token-mean PPO + entropy bonus) from the hidden states: the
      logits materialised, rlops fused linear then the losses, and ``linear_policy_loss`` (one
      pass over the vocabulary, the gradients made in the forward).

    Distillation has its own section (:func:`bench_distillation`). ``progress()`` after each
    of the four cases.
    """
    device = torch.device(device)
    kw: dict[str, Any] = dict(device=device, repeats=repeats, counts=thread_counts(device, threads))
    rows = []
    for n in token_counts:
        logits, tiny = {"t": n, "v": vocab}, {"t": 8, "v": 64}
        linear, tiny_linear = {"n": n, "v": vocab, "h": hidden}, {"n": 8, "v": 64, "h": 8}
        cases: list[tuple[str, str, dict[str, Setup]]] = [
            ("log-prob + entropy", f"{n}x{vocab}", {
                "unfused (log_softmax)": (setup_logits, {**logits, "fused": False},
                                          {**tiny, "fused": False}),
                "rlops fused": (setup_logits, {**logits, "fused": True}, {**tiny, "fused": True}),
            }),
            ("output layer + log-prob + entropy", f"{n}x{vocab}, H={hidden}", {
                "materialised logits + rlops fused": (
                    setup_linear, {**linear, "fused": False}, {**tiny_linear, "fused": False}),
                "rlops fused linear": (
                    setup_linear, {**linear, "fused": True}, {**tiny_linear, "fused": True}),
            }),
            (f"top-p {top_p} output layer", f"{n}x{vocab}, H={hidden}", {
                "materialised + keep mask": (
                    setup_linear, {**linear, "fused": False, "top_p": top_p},
                    {**tiny_linear, "fused": False, "top_p": top_p}),
                "rlops fused linear top-p": (
                    setup_linear, {**linear, "fused": True, "top_p": top_p},
                    {**tiny_linear, "fused": True, "top_p": top_p}),
            }),
            ("PPO loss phase from the output layer", f"{n}x{vocab}, H={hidden}", {
                f"materialised + {label}" if label == "losses" else label: (
                    setup_policy_step, {**linear, "variant": variant},
                    {**tiny_linear, "variant": variant})
                for label, variant in (("losses", "materialised"),
                                       ("rlops fused linear + losses", "fused"),
                                       ("rlops linear_policy_loss", "one pass"))
            }),
        ]  # fmt: skip
        for case, shape, variants in cases:
            ours = list(variants)[-1]  # rlops' own: the last variant
            rows += _case_rows("logprobs", case, n, shape, variants, ours, **kw)
            if progress is not None:
                progress()
    return rows


# The variants of bench_distillation's cases: (label, variant of setup_distillation).
_DISTILLATION = (
    ("verl default (log_softmax, gather)", "materialised"),
    ("verl chunked (use_chunked_topk)", "verl chunked"),
    ("logits + rlops distillation_loss", "logits op"),
    ("rlops linear_distillation_loss", "linear op"),
)


def bench_distillation(
    token_counts: list[int],
    vocab: int,
    *,
    hidden: int = 512,
    k: int = 64,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    threads: int | None = None,
    progress: Callback = None,
) -> list[Row]:
    """Top-k forward-KL distillation from ``[N, hidden]`` hidden states and a ``[vocab,
    hidden]`` output weight (:func:`rlops.measure.workloads.setup_distillation`), forward +
    backward of the token mean, time (the variants of a case interleaved) and peak extra
    memory, for each token count N:

    * over the teacher's top-k (``min(k, vocab)``): verl's default path (the logits,
      ``log_softmax``, gather), verl's ``use_chunked_topk`` path (a ``logsumexp`` and a gather
      per chunk of 4096 rows), the logits then ``distillation_loss``, and
      ``linear_distillation_loss`` (no ``[N, vocab]`` logits);
    * the same with the tail (the rest of the vocabulary as one bucket): verl has no tail, so
      the materialised path with the tail written plainly, and the two rlops ops.

    ``progress()`` after each of the two cases.
    """
    device = torch.device(device)
    kw: dict[str, Any] = dict(device=device, repeats=repeats, counts=thread_counts(device, threads))
    rows = []
    k = min(k, vocab)
    # with the tail: verl has none, so its default path is no longer verl's, and no chunked path
    tail_label = {"verl default (log_softmax, gather)": "materialised + tail (log_softmax, gather)"}
    for n in token_counts:
        step = {"n": n, "v": vocab, "h": hidden, "k": k}
        prime = {"n": 8, "v": 64, "h": 8, "k": min(k, 8)}
        shape = f"{n}x{vocab}, H={hidden}, k={k}"
        for tail in (False, True):
            variants: dict[str, Setup] = {
                tail_label.get(label, label) if tail else label: (
                    setup_distillation,
                    {**step, "variant": variant, "tail": tail},
                    {**prime, "variant": variant, "tail": tail},
                )
                for label, variant in _DISTILLATION
                if not (tail and variant == "verl chunked")
            }
            case = f"top-k forward KL{' + tail' if tail else ''} from the output layer"
            rows += _case_rows("distillation", case, n, shape, variants, _DISTILLATION[-1][0], **kw)
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
    forward + backward, time (the two variants of a case interleaved) and peak extra memory,
    for each token count N:

    * a fraction ``valid`` of the rows valid: every row computed vs ``mask=`` (the others cost
      nothing);
    * ``ids`` kept ids per row: a dense ``[N, vocab]`` ``keep_mask`` vs the CSR sets.

    ``progress()`` after each of the two cases.
    """
    device = torch.device(device)
    kw: dict[str, Any] = dict(device=device, repeats=repeats, counts=thread_counts(device, threads))
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
            variants: dict[str, Setup] = {}
            for label, form in methods:
                step = {"n": n, "v": vocab, "h": hidden, "form": form, "valid": valid, "ids": ids}
                prime = {**step, "n": 8, "v": 64, "h": 8, "ids": min(ids, 8)}
                variants[label] = (setup_agentic, step, prime)
            rows += _case_rows("agentic", case, n, shape, variants, methods[1][0], **kw)
            if progress is not None:
                progress()
    return rows
