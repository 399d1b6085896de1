"""The implementations rlops replaces, written from their public descriptions, for benchmarks.

* ``gae_token_loop``: the per-token Python loop over time that trainers ship (vectorised over
  the batch only).
* ``gae_chunk_loop``: the chunk-scan design (chunk-local matmul with a C x C decay matrix, then
  carries passed from chunk to chunk by a Python loop over T / C chunks), scalar decay only.
  With ``values = 0`` and ``lam = 1`` it is the same design's discounted returns.
* ``returns_token_loop``: discounted returns per sample, a loop over samples and tokens.
* ``masked_whiten_moments``: whitening over the response tokens, as verl writes it.
* ``group_loop``: GRPO / RLOO / REINFORCE++-baseline with a dict of lists per group id and a
  loop over samples; ``remax_flip_cumsum``: ReMax's vectorised flip-cumsum form.
* ``logprobs_entropy_unfused``: ``log_softmax`` + gather and the softmax entropy over the full
  vocabulary, every ``[..., V]`` temporary materialised (as verl's ``entropy_from_logits``).
* ``topk_forward_kl_log_softmax`` and ``topk_forward_kl_chunked``: verl's two paths to the
  top-k forward KL of distillation from the student's logits, the default (``log_softmax``
  over the vocabulary, gather) and ``use_chunked_topk`` (gather minus a ``logsumexp`` per
  chunk of rows, under autograd).

``tests/cli/test_baselines.py`` checks that each gives the values of the rlops function it is
measured against.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = [
    "gae_chunk_loop",
    "gae_token_loop",
    "group_loop",
    "logprobs_entropy_unfused",
    "masked_whiten_moments",
    "remax_flip_cumsum",
    "returns_token_loop",
    "topk_forward_kl_chunked",
    "topk_forward_kl_log_softmax",
]


def gae_token_loop(rewards, values, gamma: float, lam: float):
    b, t_len = rewards.shape
    last = torch.zeros(b, device=rewards.device, dtype=rewards.dtype)
    adv_rev = []
    for t in reversed(range(t_len)):
        next_value = values[:, t + 1] if t < t_len - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        adv_rev.append(last)
    adv = torch.stack(adv_rev[::-1], dim=1)
    return adv, values + adv


def gae_chunk_loop(rewards, values, gamma: float, lam: float, chunk_size: int = 256):
    b, t_len = rewards.shape
    w = gamma * lam
    next_values = torch.cat([values[:, 1:], values.new_zeros(b, 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    rev = deltas.flip(-1)
    c = chunk_size
    pad = -t_len % c
    if pad:
        rev = torch.cat([rev, rev.new_zeros(b, pad)], dim=1)
    chunks = rev.view(b, -1, c)
    i = torch.arange(c, device=rewards.device, dtype=torch.float64)
    lag = i[:, None] - i[None, :]  # t - k
    kernel = torch.where(lag >= 0, w ** lag.clamp(min=0), 0.0).to(rewards.dtype)  # [t, k]
    local = chunks @ kernel.T  # s[t] = sum_{k<=t} w^(t-k) x[k]
    pow_vec = (w ** (i + 1)).to(rewards.dtype)
    out = torch.empty_like(local)
    s_prev = rewards.new_zeros(b, 1)
    for ci in range(local.shape[1]):
        s = local[:, ci] + s_prev * pow_vec
        out[:, ci] = s
        s_prev = s[:, -1:]
    adv = out.reshape(b, -1)[:, :t_len].flip(-1)
    return adv, values + adv


def returns_token_loop(token_rewards: list[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """Discounted returns per sample, a Python loop over samples and tokens (the REINFORCE++
    returns as trainers first wrote them: one list entry per response)."""
    out = []
    for r in token_rewards:
        ret = torch.empty_like(r)
        running = r.new_zeros(())
        for t in reversed(range(r.shape[0])):
            running = r[t] + gamma * running
            ret[t] = running
        out.append(ret)
    return out


def masked_whiten_moments(x, mask):
    """Whitening by ``E[x]`` and an unbiased variance from ``E[(x - mean)^2]``, as verl does."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = ((x - mean) ** 2 * mask).sum() / n * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def group_loop(scores, index, mask, kind, eps=1e-6):
    """Group-baseline advantages with a dict of lists per group id and a loop over samples."""
    scores = scores.clone()
    by_id: defaultdict = defaultdict(list)
    mean: dict = {}
    std: dict = {}
    for i in range(scores.shape[0]):
        by_id[index[i]].append(scores[i])
    for k, vals in by_id.items():
        g = torch.stack(vals)
        mean[k], std[k] = (g.mean(), g.std()) if len(vals) > 1 else (torch.tensor(0.0), 1.0)
    for i in range(scores.shape[0]):
        k, n = index[i], len(by_id[index[i]])
        if kind == "grpo":
            scores[i] = (scores[i] - mean[k]) / (std[k] + eps)
        elif kind == "rloo" and n > 1:
            scores[i] = (scores[i] - mean[k]) * n / (n - 1)
        elif kind == "rfpp":
            scores[i] = scores[i] - mean[k]
    adv = scores[:, None] * mask
    adv = masked_whiten_moments(adv, mask) * mask if kind == "rfpp" else adv
    return adv, adv


def remax_flip_cumsum(rewards, baselines, mask):
    """ReMax as a flip-cumsum over the masked rewards minus the greedy baseline."""
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - baselines[:, None] * mask, returns


def logprobs_entropy_unfused(logits: torch.Tensor, target: torch.Tensor):
    """``log_softmax`` + ``gather`` and the softmax entropy ``logsumexp(z) - sum(p * z)``,
    materialised in float32 (or the logits' dtype if wider)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    return logp, entropy


def topk_forward_kl_log_softmax(
    logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor, *, tail=False
) -> torch.Tensor:
    """Per-token ``sum_j p_j (log p_j - log q_j)`` over the teacher's top-k ``[..., k]``, with
    ``log q = log_softmax(logits).gather(ids)``: the ``[..., V]`` log-softmax is made, kept
    for the backward, and its gradient made whole (verl's default path). ``tail``: plus the
    rest of the vocabulary as one bucket, ``p_r log(p_r / q_r)``, ``p_r = 1 - sum_j p_j``
    (not verl's: it has no tail)."""
    s = torch.log_softmax(logits, -1).gather(-1, teacher_ids)
    loss = (teacher_logp.exp() * (teacher_logp - s)).sum(-1)
    if tail:
        pt, ps = 1 - teacher_logp.exp().sum(-1), 1 - s.exp().sum(-1)
        loss = loss + pt * (pt.log() - ps.log())
    return loss


def topk_forward_kl_chunked(
    logits: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_ids: torch.Tensor,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """The same forward KL (no tail) by verl's ``use_chunked_topk`` path: the rows of
    ``logits [..., V]`` in chunks of ``chunk_size`` (verl's default), each chunk's
    ``gather(ids) - logsumexp`` (in float32, or wider) written into a ``[rows, k]`` buffer under
    autograd. Its forward makes no ``[..., V]`` log-softmax; its backward makes, per chunk,
    the ``logsumexp`` and gather gradients of the chunk and the slice's gradient the size of
    the whole logits. Float64 stays float64 (verl casts to float32)."""
    v, k = logits.shape[-1], teacher_ids.shape[-1]
    flat, ids = logits.reshape(-1, v), teacher_ids.reshape(-1, k)
    wide = torch.promote_types(logits.dtype, torch.float32)
    log_q = torch.empty(ids.shape, dtype=logits.dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        rows = flat[start : start + chunk_size].to(wide)
        lse = torch.logsumexp(rows, dim=-1, keepdim=True)
        got = torch.gather(rows, -1, ids[start : start + chunk_size]) - lse
        log_q[start : start + chunk_size] = got.to(logits.dtype)
    log_q, log_p = log_q.reshape(teacher_ids.shape).to(wide), teacher_logp.to(wide)
    return (log_p.exp() * (log_p - log_q)).sum(-1)
