"""The implementations rlops replaces, written from their public descriptions, for benchmarks.

* ``gae_token_loop``: the per-token Python loop over time that trainers ship (vectorised over
  the batch only).
* ``gae_chunk_loop``: the chunk-scan design (chunk-local matmul with a C x C decay matrix, then
  carries passed from chunk to chunk by a Python loop over T / C chunks), scalar decay only.
"""

from __future__ import annotations

import torch

__all__ = ["gae_chunk_loop", "gae_token_loop"]


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
