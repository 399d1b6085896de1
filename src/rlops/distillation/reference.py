"""The plain definition of :func:`rlops.distillation_loss` (one process, whole vocabulary), for
tests: ``log_softmax`` over ``[..., V]``, a gather, the buckets' probabilities, the sum."""

from __future__ import annotations

import torch

__all__ = ["distillation_reference"]


def distillation_reference(
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    tail: bool = False,
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The per-token divergence, written from its definition, in ``logits``' dtype."""
    logp_s = torch.log_softmax(logits / temperature, dim=-1)
    logp_t = teacher_logprobs.detach().to(logp_s.dtype)
    if teacher_ids is not None:
        logp_s_k = logp_s.gather(-1, teacher_ids)
        p_s_tail = 1 - logp_s_k.exp().sum(-1)
        p_t_tail = 1 - logp_t.exp().sum(-1)
        logp_s = logp_s_k
    if log_prob_min_clamp is not None:
        logp_s = logp_s.clamp_min(log_prob_min_clamp)
        logp_t = logp_t.clamp_min(log_prob_min_clamp)
    if teacher_ids is not None and tail and teacher_ids.shape[-1] < logits.shape[-1]:
        logp_s = torch.cat([logp_s, p_s_tail.log().unsqueeze(-1)], -1)
        logp_t = torch.cat([logp_t, p_t_tail.log().unsqueeze(-1)], -1)
    p_s, p_t = logp_s.exp(), logp_t.exp()
    if kind == "forward_kl":
        return (p_t * (logp_t - logp_s)).sum(-1)
    if kind == "reverse_kl":
        return (p_s * (logp_s - logp_t)).sum(-1)
    m = beta * p_t + (1 - beta) * p_s
    kl_t = (p_t * (logp_t - m.log())).sum(-1)
    kl_s = (p_s * (logp_s - m.log())).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s
