"""One PPO training step on the tiny transformer, naive implementations beside rlops, stage by
stage: what ``rlops profile`` times and measures.

The step runs over ``[B, T]`` tokens with a response mask (prompt and right padding 0) and
stored rollout data (old and reference log-probs, old values, an outcome reward on the last
response token):

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

import contextlib
import statistics
import time
from typing import Any

import torch

import rlops
from rlops.measure import baselines
from rlops.measure.timing import PeakMemory, sync
from rlops.measure.workloads import top_p_keep_mask

__all__ = [
    "HEADS",
    "IMPLS",
    "OUTPUT",
    "STAGES",
    "make_batch",
    "naive_advantages",
    "naive_logprobs",
    "naive_losses",
    "ppo_step",
    "profile_step",
    "profile_whole_step",
    "rlops_advantages",
    "rlops_losses",
]

STAGES = ("forward", "log-prob + entropy", "value head", "advantages", "losses", "backward")
IMPLS = ("naive", "rlops")
HEADS = ("fused-linear", "logits")  # how the rlops step goes from hidden states to log-probs
# the two stages between the trunk and the log-probs, also timed and measured as one: with the
# fused-linear head the LM head moves from the first into the second
OUTPUT, OUTPUT_STAGES = "forward + log-prob + entropy", STAGES[:2]

GAMMA, LAM, CLIP, VALUE_COEF, ENTROPY_COEF, KL_COEF = 1.0, 0.95, 0.2, 0.5, 0.01, 0.01


# --------------------------------------------------------------------------- the data
def make_batch(cfg, batch: int, seq_len: int, device, gen: torch.Generator):
    """Tokens ``[B, T + 1]`` (below ``cfg.vocab``) and the stored rollout data of one PPO step,
    each ``[B, T]``."""
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
    model: Any,
    data: dict,
    impl: str,
    stage,
    *,
    head: str = "fused-linear",
    top_p: float | None = None,
) -> torch.Tensor:
    """One PPO training step (gradients left in ``model``); returns the loss, detached.

    ``model``: ``trunk(tokens)`` -> hidden states, ``logits(hidden)`` through the linear
    ``model.head``, ``values(hidden)``. ``stage(name)`` is a context manager wrapping each
    stage. ``head``: how the rlops step goes
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
        logits: Any = None if fused_head else model.logits(hidden)
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
        advantages = naive_advantages if naive else rlops_advantages
        adv, ret = advantages(data["rewards"], data["old_values"], data["mask"])
    with stage("losses"):
        losses = naive_losses if naive else rlops_losses
        loss = losses(logp, entropy, values, adv, ret, data)
    with stage("backward"):
        loss.backward()
    return loss.detach()


def profile_step(model, data, device, repeats: int = 5, progress=None, **step_kw) -> dict:
    """``{impl: {stage: {"seconds": median, "peak_bytes": int | None}}}`` for both impls, for
    each of :data:`STAGES` and :data:`OUTPUT` (the forward and the log-prob stages as one span:
    the median of their summed times, the peak over the span in one more step).

    The timed steps alternate between the implementations, so that both see the same
    machine (other processes, clock speed) as closely as possible. ``step_kw``: ``head`` and
    ``top_p`` of :func:`ppo_step`.
    """
    times: dict[str, dict[str, list[float]]] = {
        impl: {s: [] for s in (*STAGES, OUTPUT)} for impl in IMPLS
    }
    peaks: dict[str, dict[str, int | None]] = {impl: {} for impl in IMPLS}

    def timed(impl):
        @contextlib.contextmanager
        def stage(name):
            sync(device)
            t0 = time.perf_counter()
            yield
            sync(device)
            times[impl][name].append(time.perf_counter() - t0)
            if name == OUTPUT_STAGES[-1]:
                times[impl][OUTPUT].append(sum(times[impl][s][-1] for s in OUTPUT_STAGES))

        return stage

    def measured(impl, spans: bool):
        span = PeakMemory(device)

        @contextlib.contextmanager
        def stage(name):
            if not spans:
                with PeakMemory(device) as peak:
                    yield
                peaks[impl][name] = peak.bytes
                return
            if name == OUTPUT_STAGES[0]:
                span.__enter__()
            yield
            if name == OUTPUT_STAGES[-1]:
                span.__exit__(None, None, None)
                peaks[impl][OUTPUT] = span.bytes

        return stage

    for impl in IMPLS:  # warm-up
        ppo_step(model, data, impl, lambda name: contextlib.nullcontext(), **step_kw)
    for _ in range(repeats):
        for impl in IMPLS:
            ppo_step(model, data, impl, timed(impl), **step_kw)
            if progress is not None:
                progress()
    for impl in IMPLS:
        for spans in (False, True):
            ppo_step(model, data, impl, measured(impl, spans), **step_kw)
        if progress is not None:
            progress()
    model.zero_grad(set_to_none=True)
    return {
        impl: {
            s: {"seconds": statistics.median(times[impl][s]), "peak_bytes": peaks[impl][s]}
            for s in (*STAGES, OUTPUT)
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
