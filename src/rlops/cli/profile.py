"""``rlops profile``: one PPO training step, stage by stage, naive implementations beside rlops.

The step runs on a tiny causal transformer (random weights) over ``[B, T]`` tokens with a
response mask (prompt and right padding 0) and stored rollout data (old and reference
log-probs, old values, an outcome reward on the last response token):

=====================  ======================================  ===============================
stage                  naive (as commonly written)             rlops
=====================  ======================================  ===============================
forward                trunk + LM head -> logits [B, T, V]      trunk -> hidden states
                                                                (``--rlops-head logits``: same
                                                                as naive)
log-prob + entropy     log_softmax + gather, softmax entropy    ``linear_logprobs_and_entropy``
                       (``[B, T, V]`` float32 temporaries)      on the hidden states and the LM
                                                                head's weight, no ``[B, T, V]``
                                                                logits (``--rlops-head logits``:
                                                                ``logprobs_and_entropy`` on
                                                                them); both token-chunked with
                                                                a fused backward
 (with ``--top-p P``)  a ``[B, T, V]`` keep mask (sort,         ``top_p=P`` inside the fused op
                       cumsum, scatter), masked log_softmax     (the support per chunk)
value head             linear on the hidden states              same
advantages             per-token Python loop GAE, whitening     ``gae`` (mask-aware scan),
                                                                ``masked_whiten``
losses                 PPO clip, clipped value loss, k3 KL      ``policy_loss``, ``value_loss``,
                                                                ``kl_penalty``, ``masked_mean``
backward               autograd                                 autograd
=====================  ======================================  ===============================

Each stage's time is the median over ``--repeats`` steps per implementation (after one warm-up
step; the two implementations take turns). Its peak memory is measured in one more step: the
most memory the stage held on top of what was live when it began (what it keeps for the
backward included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

import rlops
from rlops.cli import baselines, options
from rlops.cli.display import Progress, fmt_mib, fmt_ms, print_table, say
from rlops.cli.measure import PeakMemory, sync
from rlops.cli.model import ModelConfig, TinyTransformer
from rlops.cli.options import positive_int
from rlops.cli.workloads import top_p_keep_mask

__all__ = ["HEADS", "STAGES", "add_arguments", "profile_step", "run"]

STAGES = ("forward", "log-prob + entropy", "value head", "advantages", "losses", "backward")
SAME_CODE = ("forward", "value head")  # both run the same code here (forward: rlops head logits)
IMPLS = ("naive", "rlops")
HEADS = ("fused-linear", "logits")  # how the rlops step goes from hidden states to log-probs
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

GAMMA, LAM, CLIP, VALUE_COEF, ENTROPY_COEF, KL_COEF = 1.0, 0.95, 0.2, 0.5, 0.01, 0.01


# --------------------------------------------------------------------------- the data
def make_batch(cfg: ModelConfig, batch: int, seq_len: int, device, gen: torch.Generator):
    """Tokens ``[B, T + 1]`` and the stored rollout data of one PPO step, each ``[B, T]``."""
    tokens = torch.randint(0, cfg.vocab, (batch, seq_len + 1), generator=gen)
    pos = torch.arange(seq_len)
    prompt = seq_len // 4
    length = torch.randint(seq_len // 2, seq_len - prompt + 1, (batch, 1), generator=gen)
    mask = ((pos >= prompt) & (pos < prompt + length)).float()
    old_logp = -torch.rand(batch, seq_len, generator=gen) * 2 - 8.0
    ref_logp = old_logp + 0.1 * torch.randn(batch, seq_len, generator=gen)
    old_values = torch.randn(batch, seq_len, generator=gen)
    rewards = torch.zeros(batch, seq_len)
    last = (prompt + length - 1).squeeze(1)
    rewards[torch.arange(batch), last] = torch.rand(batch, generator=gen)
    out = dict(
        tokens=tokens,
        mask=mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        old_values=old_values,
        rewards=rewards,
    )
    return {k: v.to(device) for k, v in out.items()}


# --------------------------------------------------------------------------- naive stages
def naive_logprobs(logits, target, top_p: float | None = None):
    """``log_softmax`` + gather and the softmax entropy; with ``top_p``, the log-prob over a
    ``[B, T, V]`` keep mask of the top-p support (sort, cumsum, scatter), the entropy over all
    logits (as rlops' ``top_p``)."""
    if top_p is None:
        return baselines.logprobs_entropy_unfused(logits, target)
    keep = top_p_keep_mask(logits, top_p, target)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    logp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(z, dim=-1)
    entropy = torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
    return logp, entropy


def naive_advantages(rewards, values, mask):
    """Per-token Python loop GAE, then whitening over the response tokens."""
    adv, ret = baselines.gae_token_loop(rewards * mask, values * mask, GAMMA, LAM)
    return baselines.masked_whiten_moments(adv, mask) * mask, ret * mask


def naive_losses(logp, entropy, values, adv, ret, data):
    """PPO clipped surrogate, clipped value loss, k3 KL, entropy bonus; token means."""
    mask, old_logp = data["mask"], data["old_logp"]
    n = mask.sum()
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    v_clip = data["old_values"] + (values - data["old_values"]).clamp(-CLIP, CLIP)
    vf = 0.5 * torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
    d = data["ref_logp"] - logp
    kl = torch.exp(d) - d - 1
    per_token = pg + VALUE_COEF * vf + KL_COEF * kl - ENTROPY_COEF * entropy
    return (per_token * mask).sum() / n


def rlops_losses(logp, entropy, values, adv, ret, data):
    """The same losses from rlops."""
    mask = data["mask"]
    pg, _ = rlops.policy_loss(logp, data["old_logp"], adv, mask, clip_low=CLIP)
    vf, _ = rlops.value_loss(values, data["old_values"], ret, mask, clip=CLIP)
    kl = rlops.masked_mean(rlops.kl_penalty(logp, data["ref_logp"], "k3"), mask)
    ent = rlops.masked_mean(entropy, mask)
    return pg + VALUE_COEF * vf + KL_COEF * kl - ENTROPY_COEF * ent


def rlops_advantages(rewards, values, mask):
    """GAE on the mask-aware scan, then masked whitening."""
    adv, ret = rlops.gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask)
    return rlops.masked_whiten(adv, mask), ret


# --------------------------------------------------------------------------- one step
def ppo_step(
    model: TinyTransformer,
    data: dict,
    impl: str,
    stage,
    *,
    head: str = "fused-linear",
    top_p: float | None = None,
) -> torch.Tensor:
    """One PPO training step (gradients left in ``model``); returns the loss, detached.

    ``stage(name)`` is a context manager wrapping each stage. ``head``: how the rlops step goes
    from the final hidden states to the log-probs (``fused-linear``: the LM head inside
    ``linear_logprobs_and_entropy``; ``logits``: materialised logits, then
    ``logprobs_and_entropy``). ``top_p``: replay a top-p sampler's support.
    """
    naive = impl == "naive"
    fused_head = not naive and head == "fused-linear"
    model.zero_grad(set_to_none=True)
    tokens = data["tokens"]
    with stage("forward"):
        hidden = model.trunk(tokens[:, :-1])
        logits = None if fused_head else model.logits(hidden)
    with stage("log-prob + entropy"):
        target = tokens[:, 1:]
        if naive:
            logp, entropy = naive_logprobs(logits, target, top_p)
        elif fused_head:
            logp, entropy = rlops.linear_logprobs_and_entropy(
                hidden, model.head.weight, target, top_p=top_p
            )
        else:
            logp, entropy = rlops.logprobs_and_entropy(logits, target, top_p=top_p)
    with stage("value head"):
        values = model.values(hidden).float()
    with stage("advantages"), torch.no_grad():
        fn = naive_advantages if naive else rlops_advantages
        adv, ret = fn(data["rewards"], data["old_values"], data["mask"])
    with stage("losses"):
        fn = naive_losses if naive else rlops_losses
        loss = fn(logp, entropy, values, adv, ret, data)
    with stage("backward"):
        loss.backward()
    return loss.detach()


def profile_step(model, data, device, repeats: int = 5, progress=None, **step_kw) -> dict:
    """``{impl: {stage: {"seconds": median, "peak_bytes": int | None}}}`` for both impls.

    The timed steps alternate between the implementations, so that both see the same
    machine (other processes, clock speed) as closely as possible. ``step_kw``: ``head`` and
    ``top_p`` of :func:`ppo_step`.
    """
    times = {impl: {s: [] for s in STAGES} for impl in IMPLS}
    peaks = {impl: {} for impl in IMPLS}

    def timed(impl):
        @contextlib.contextmanager
        def stage(name):
            sync(device)
            t0 = time.perf_counter()
            yield
            sync(device)
            times[impl][name].append(time.perf_counter() - t0)

        return stage

    def measured(impl):
        @contextlib.contextmanager
        def stage(name):
            with PeakMemory(device) as peak:
                yield
            peaks[impl][name] = peak.bytes

        return stage

    for impl in IMPLS:  # warm-up
        ppo_step(model, data, impl, lambda name: contextlib.nullcontext(), **step_kw)
    for _ in range(repeats):
        for impl in IMPLS:
            ppo_step(model, data, impl, timed(impl), **step_kw)
            if progress is not None:
                progress()
    for impl in IMPLS:
        ppo_step(model, data, impl, measured(impl), **step_kw)
        if progress is not None:
            progress()
    model.zero_grad(set_to_none=True)
    return {
        impl: {
            s: {"seconds": statistics.median(times[impl][s]), "peak_bytes": peaks[impl][s]}
            for s in STAGES
        }
        for impl in IMPLS
    }


def profile_whole_step(model, data, device, **step_kw) -> dict:
    """``{impl: peak_bytes}`` of one whole step (memory live at its start excluded)."""
    out = {}
    for impl in IMPLS:
        with PeakMemory(device) as peak:
            ppo_step(model, data, impl, lambda name: contextlib.nullcontext(), **step_kw)
        out[impl] = peak.bytes
    model.zero_grad(set_to_none=True)
    return out


# --------------------------------------------------------------------------- command line
def add_arguments(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` on an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "profile",
        help="time and measure each stage of one PPO step, naive beside rlops",
        description="One PPO training step on a tiny transformer: per-stage time and peak "
        "memory, the common naive implementations beside rlops.",
    )
    for name, metavar, default, text in (
        ("batch", "B", 2, "rows"),
        ("seq-len", "T", 1024, "tokens per row"),
        ("vocab", "V", 16384, "vocabulary size"),
        ("layers", "N", 2, "transformer blocks"),
        ("d-model", "D", 128, "model width"),
        ("heads", "N", 4, "attention heads"),
        ("repeats", "N", 5, "timed steps per implementation"),
    ):
        p.add_argument(
            f"--{name}",
            metavar=metavar,
            type=positive_int,
            default=default,
            help=f"{text} (default {default})",
        )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="float32",
        help="model and logits dtype (default float32)",
    )
    p.add_argument(
        "--rlops-head",
        choices=HEADS,
        default=HEADS[0],
        help="how the rlops step computes the log-probs from the final hidden states: "
        "fused-linear (the LM head inside linear_logprobs_and_entropy, no [B, T, V] logits) "
        "or logits (materialised, as naive, then logprobs_and_entropy) (default fused-linear)",
    )
    p.add_argument(
        "--top-p",
        metavar="P",
        type=options.top_p,
        help="replay a top-p sampler's support: naive builds a [B, T, V] keep mask (sort, "
        "cumsum, scatter), rlops passes top_p to the fused op (default: none, the full "
        "softmax)",
    )
    options.add_device(p)
    p.add_argument(
        "--threads",
        metavar="N",
        type=positive_int,
        help="torch intra-op threads (default: torch's choice); 1 gives steadier numbers on "
        "a machine whose cores are busy with other work",
    )
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    options.add_outputs(
        p,
        json="also write the measurements as JSON",
        plot="save time and memory per stage as a PNG",
    )
    return p


def _check(args: argparse.Namespace) -> str | None:
    """An error message for options that parse but cannot run together, else None."""
    if args.seq_len < 2:
        return f"--seq-len must be at least 2, got {args.seq_len}"
    if args.vocab < 2:
        return f"--vocab must be at least 2, got {args.vocab}"
    if args.d_model % args.heads:
        return f"--d-model {args.d_model} is not a multiple of --heads {args.heads}"
    return None


HEADER = ["stage", "naive ms", "%", "rlops ms", "%", "speed-up", "naive MiB", "rlops MiB"]
CAPTION = "MiB: most memory a stage held beyond what was live at its start"


def same_code(head: str) -> tuple[str, ...]:
    """The stages both implementations run with the same code, for an rlops ``head``."""
    return SAME_CODE if head == "logits" else tuple(s for s in SAME_CODE if s != "forward")


def _rows(result: dict, step_peak: dict, same: tuple[str, ...] = SAME_CODE) -> list[list[str]]:
    totals = {i: sum(result[i][s]["seconds"] for s in STAGES) for i in IMPLS}
    rows = []
    for s in STAGES:
        n, r = result["naive"][s], result["rlops"][s]
        rows.append(
            [
                s,
                fmt_ms(n["seconds"]),
                f"{100 * n['seconds'] / totals['naive']:.1f}%",
                fmt_ms(r["seconds"]),
                f"{100 * r['seconds'] / totals['rlops']:.1f}%",
                "same code" if s in same else f"{n['seconds'] / r['seconds']:.2f}x",
                fmt_mib(n["peak_bytes"]),
                fmt_mib(r["peak_bytes"]),
            ]
        )
    rows.append(
        [
            "whole step",
            fmt_ms(totals["naive"]),
            "100%",
            fmt_ms(totals["rlops"]),
            "100%",
            f"{totals['naive'] / totals['rlops']:.2f}x",
            fmt_mib(step_peak["naive"]),
            fmt_mib(step_peak["rlops"]),
        ]
    )
    return rows


def verdict(result: dict, step_peak: dict, same: tuple[str, ...] = SAME_CODE) -> str:
    """Plain words: the step before and after, the stage that gained most time (in ms) and the
    one that gained most memory (in MiB), and what dominates the step with rlops."""
    totals = {i: sum(result[i][s]["seconds"] for s in STAGES) for i in IMPLS}
    differ = [s for s in STAGES if s not in same]

    def saved(s: str, key: str) -> float:
        return (result["naive"][s][key] or 0) - (result["rlops"][s][key] or 0)

    def change(s: str, key: str) -> str:
        n, r = result["naive"][s][key], result["rlops"][s][key]
        if key == "seconds":
            return f"{fmt_ms(n)} -> {fmt_ms(r)} ms"
        return f"peak {fmt_mib(n)} -> {fmt_mib(r)} MiB"

    lines = [
        f"One PPO step: {fmt_ms(totals['naive'])} ms -> {fmt_ms(totals['rlops'])} ms "
        f"({totals['naive'] / totals['rlops']:.2f}x); peak memory "
        f"{fmt_mib(step_peak['naive'])} -> {fmt_mib(step_peak['rlops'])} MiB.",
    ]
    best = {key: max(differ, key=lambda s, k=key: saved(s, k)) for key in ("seconds", "peak_bytes")}
    gains = [(key, s) for key, s in best.items() if saved(s, key) > 0]
    if len(gains) == 2 and best["seconds"] == best["peak_bytes"]:
        s = best["seconds"]
        lines.append(
            f"Largest time and memory gain: {s}, {change(s, 'seconds')}, {change(s, 'peak_bytes')}."
        )
    else:
        for key, s in gains:
            label = "time" if key == "seconds" else "memory"
            lines.append(f"Largest {label} gain: {s}, {change(s, key)}.")
    if not gains:
        lines.append("No stage takes less time or memory with rlops at this size.")
    top = sorted(STAGES, key=lambda s: -result["rlops"][s]["seconds"])[:2]
    shares = ", ".join(
        f"{s} {100 * result['rlops'][s]['seconds'] / totals['rlops']:.0f}%" for s in top
    )
    lines.append(f"With rlops the step is dominated by {shares}.")
    return "\n".join(lines)


def save_plot(result: dict, step_peak: dict, title: str, path: str) -> None:
    """Time per stage (stacked bars) and peak memory per stage (grouped bars) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    colors = plt.get_cmap("tab10").colors
    for y, impl in enumerate(IMPLS):
        left = 0.0
        for k, s in enumerate(STAGES):
            ms = 1e3 * result[impl][s]["seconds"]
            ax_t.barh(y, ms, left=left, color=colors[k], label=s if y == 0 else None)
            left += ms
    ax_t.set_yticks(range(len(IMPLS)), IMPLS)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("time per step (ms)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    width = 0.4
    for j, impl in enumerate(IMPLS):
        mib = [(result[impl][s]["peak_bytes"] or 0) / 2**20 for s in STAGES]
        ax_m.bar([i + (j - 0.5) * width for i in range(len(STAGES))], mib, width, label=impl)
    ax_m.set_xticks(range(len(STAGES)), STAGES, rotation=20, ha="right", fontsize=8)
    ax_m.set_ylabel("peak memory of the stage (MiB)")
    ax_m.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``rlops profile``: measure, print the table and the verdict, optionally plot / JSON."""
    error = _check(args)
    if error is not None:
        print(f"rlops profile: error: {error}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = ModelConfig(
        vocab=args.vocab,
        context=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    )
    model = TinyTransformer(cfg).to(device=device, dtype=dtype)
    data = make_batch(cfg, args.batch, args.seq_len, device, gen)
    step_kw = {"head": args.rlops_head, "top_p": args.top_p}
    sampler = "" if args.top_p is None else f", top-p {args.top_p}"
    title = (
        f"One PPO step, B={args.batch}, T={args.seq_len}, V={args.vocab}, layers={args.layers}, "
        f"d_model={args.d_model}, {args.dtype}, {device}, torch threads={torch.get_num_threads()}"
        f", rlops head: {args.rlops_head}{sampler}"
    )
    say(title)
    with Progress(2 * (args.repeats + 1), "PPO steps") as progress:
        result = profile_step(model, data, device, args.repeats, progress.update, **step_kw)
    step_peak = profile_whole_step(model, data, device, **step_kw)
    same = same_code(args.rlops_head)
    print_table(
        f"Stages of one PPO step [{args.batch}x{args.seq_len}, V={args.vocab}{sampler}]",
        HEADER,
        _rows(result, step_peak, same),
        caption=CAPTION,
        total_row=True,
    )
    say(verdict(result, step_peak, same))
    if args.plot:
        save_plot(result, step_peak, title, args.plot)
        say(f"plot saved to {args.plot}")
    if args.json:
        payload = {
            "command": "profile",
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "stages": list(STAGES),
            "results": result,
            "step_peak_bytes": step_peak,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        say(f"measurements written to {args.json}")
    return 0
