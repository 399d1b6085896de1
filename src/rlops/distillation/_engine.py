"""The chunk loops of the distillation ops: per-row statistics of the student's softmax and the
teacher's buckets in the forward, each chunk's logit gradient in the backward.

A *producer* gives rows ``i:j`` of the (local shard's) logits in the compute dtype and takes
their gradient; the op on logits slices them, the fused output layer multiplies. Top-k teacher:
one ``gather`` of ``[N, 3 + 2k]`` statistics per call (local max, softmax sum, tail sum, the
student's logits at the teacher's ids, the local top-k); full teacher: the log-normaliser's
statistics, then the rows' sums. The backward reads only what the forward saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlops._types import Group
from rlops.distillation._buckets import log1mexp, terms
from rlops.distributed.collectives import Call, gather

# Elements of one ``[C, V]`` temporary of the chunk loops (16 MiB of float32).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Spec:
    """One call's static choices."""

    kind: str
    tail: bool
    beta: float
    clamp: float | None
    tau: float
    start: int  # the shard's first id
    vocab: int  # the whole vocabulary
    group: Group = None
    world: int = 1

    def chunks(self, n: int, v_local: int) -> list[tuple[int, int]]:
        if torch.compiler.is_compiling() or n == 0:
            return [(0, n)]
        step = max(1, CHUNK_ELEMENTS // max(v_local, 1))
        return [(i, min(i + step, n)) for i in range(0, n, step)]


class Producer:
    """Rows of the logits shard ``[N, V_local]`` and the sink of their gradient."""

    rows: int
    v_local: int
    dtype: torch.dtype  # the compute dtype

    def logits(self, i: int, j: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def add_grad(self, i: int, j: int, dz: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError


def _gathered(stats: torch.Tensor, spec: Spec, what: str) -> torch.Tensor:
    """``[N, s]`` → ``[world, N, s]`` in the compute dtype (the ranks were checked before)."""
    if spec.world == 1:
        return stats.unsqueeze(0)
    call = Call("distillation_loss", statistics=what)
    return gather(stats, spec.group, call, check=False).to(stats.dtype)


def _scaled(z: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``z / τ`` in place (``τ = 1``: ``z``)."""
    return z if spec.tau == 1.0 else z.div_(spec.tau)


def _local_ids(ids: torch.Tensor, spec: Spec, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(column in this shard, clamped; inside this shard)`` of global ids."""
    local = ids - spec.start
    inside = (local >= 0) & (local < v_local)
    return local.clamp(0, max(v_local - 1, 0)), inside


def topk_forward(
    prod: Producer, a: torch.Tensor, ids: torch.Tensor, spec: Spec
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Top-k teacher: ``(loss [N], metrics, saved)``; ``a``, ``ids``: ``[N, k]``."""
    n, k, v = prod.rows, ids.shape[1], prod.v_local
    tail = spec.tail and k < spec.vocab
    kk = min(k, v)
    stats = a.new_empty((n, 3 + 2 * k))
    for i, j in spec.chunks(n, v):
        x = _scaled(prod.logits(i, j), spec)
        col, inside = _local_ids(ids[i:j], spec, v)
        xk = x.gather(1, col)
        stats[i:j, 3 : 3 + k] = torch.where(inside, xk, 0.0)
        top = x.topk(kk, dim=1, sorted=False).values
        stats[i:j, 3 + k : 3 + k + kk] = top
        stats[i:j, 3 + k + kk :] = -torch.inf
        m = top.amax(1, keepdim=True)  # the row's max is among its top-k
        e = x.sub_(m).exp_()
        stats[i:j, 0] = m[:, 0]
        stats[i:j, 1] = e.sum(1)
        if tail:  # the tail's own sum, never ``1 − Σ_K``: e − e is exactly 0
            e.scatter_add_(1, col, torch.where(inside, -e.gather(1, col), 0.0))
            stats[i:j, 2] = e.sum(1)
    rows = _gathered(stats, spec, "top-k")
    m_max = rows[:, :, 0].amax(0)
    w = (rows[:, :, 0] - m_max).exp()
    log_s = (rows[:, :, 1] * w).sum(0).log()  # the log-normaliser is m_max + log_s
    b = (rows[:, :, 3 : 3 + k].sum(0) - m_max[:, None]) - log_s[:, None]
    tops = rows[:, :, 3 + k :].permute(1, 0, 2).reshape(n, spec.world * k)
    theta = tops.topk(k, dim=1).values[:, -1:]  # the student's k-th largest logit
    overlap = rows[:, :, 3 : 3 + k].sum(0) >= theta
    student_mass = b.logsumexp(1).exp()
    a_lse = a.logsumexp(1)
    f, g = terms(spec.kind, a, b, spec.beta, spec.clamp)
    log_tail = log_s.new_zeros(n)
    if tail:
        log_tail = (rows[:, :, 2] * w).sum(0).log()  # log Σ_{j∉K} e^{x_j − m_max}
        ft, gt = terms(spec.kind, log1mexp(a_lse), log_tail - log_s, spec.beta, None)
        f, g = torch.cat([f, ft[:, None]], 1), torch.cat([g, gt[:, None]], 1)
    loss = f.sum(1)
    a_c, b_c = (a, b) if spec.clamp is None else (a.clamp_min(spec.clamp), b.clamp_min(spec.clamp))
    count = overlap.sum(1)
    adv = (-(a_c.exp() * (a_c - b_c)) * overlap).sum(1) / count.clamp_min(1)
    metrics = {
        "student_mass": student_mass,
        "teacher_mass": a_lse.exp(),
        "overlap_count": count,
        "overlap_token_advantage": torch.where(count > 0, adv, 0.0),
    }
    return loss, metrics, (g, m_max, log_s, log_tail)


def topk_backward(
    prod: Producer, ids: torch.Tensor, saved: tuple[torch.Tensor, ...], gloss: torch.Tensor,
    spec: Spec,
) -> None:  # fmt: skip
    """``dz = (ḡ/τ)·(g_K at K + g_tail·p/P_tail off K − p·Σg)``, chunk by chunk."""
    g, m_max, log_s, log_tail = saved
    n, k, v = prod.rows, ids.shape[1], prod.v_local
    gs = g * (gloss / spec.tau)[:, None]  # the upstream gradient and 1/τ folded in
    total = gs.sum(1, keepdim=True)
    tail = g.shape[1] > k
    for i, j in spec.chunks(n, v):
        x = _scaled(prod.logits(i, j), spec).sub_(m_max[i:j, None])
        col, inside = _local_ids(ids[i:j], spec, v)
        if not tail:
            dz = x.sub_(log_s[i:j, None]).exp_().mul_(-total[i:j])
            dz.scatter_add_(1, col, torch.where(inside, gs[i:j, :k], 0.0))
        elif spec.world == 1:  # off K: p·(g_tail/P_tail − Σg) = e^{x − log T}·(g_tail − Σg·P_tail)
            p_k = (x.gather(1, col) - log_s[i:j, None]).exp()
            c = gs[i:j, k:] - total[i:j] * (log_tail[i:j] - log_s[i:j]).exp()[:, None]
            dz = x.sub_(log_tail[i:j, None]).exp_().mul_(c)
            dz.scatter_(1, col, gs[i:j, :k] - p_k * total[i:j])  # K: written, never cancelled
        else:  # ids of other shards: e^{x − log T} zeroed on K exactly (x − inf)
            wt = x - log_tail[i:j, None]
            wt.scatter_add_(1, col, x.new_zeros(col.shape).masked_fill_(inside, -torch.inf))
            dz = wt.exp_().mul_(gs[i:j, k:])
            dz.add_(x.sub_(log_s[i:j, None]).exp_().mul_(-total[i:j]))
            dz.scatter_add_(1, col, torch.where(inside, gs[i:j, :k], 0.0))
        prod.add_grad(i, j, dz)


def _log_softmax(
    z: torch.Tensor, spec: Spec, m_max: torch.Tensor, log_s: torch.Tensor
) -> torch.Tensor:
    """``(z/τ − max) − log Σ``, in place, as ``log_softmax`` rounds it."""
    return _scaled(z, spec).sub_(m_max[:, None]).sub_(log_s[:, None])


def full_forward(
    prod: Producer, a: torch.Tensor, spec: Spec
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Full teacher (``a``: ``[N, V_local]``): ``(loss [N], metrics, saved)``."""
    n, v = prod.rows, prod.v_local
    chunks = spec.chunks(n, v)
    stats = a.new_empty((n, 2))
    for i, j in chunks:
        x = _scaled(prod.logits(i, j), spec)
        m = x.amax(1, keepdim=True)
        stats[i:j, 0], stats[i:j, 1] = m[:, 0], x.sub_(m).exp_().sum(1)
    rows = _gathered(stats, spec, "log-normaliser")
    m_max = rows[:, :, 0].amax(0)
    log_s = (rows[:, :, 1] * (rows[:, :, 0] - m_max).exp()).sum(0).log()
    sums = a.new_empty((n, 3))  # Σ f, Σ ∂f/∂b, Σ p_t
    for i, j in chunks:
        b = _log_softmax(prod.logits(i, j), spec, m_max[i:j], log_s[i:j])
        f, g = terms(spec.kind, a[i:j], b, spec.beta, spec.clamp)
        sums[i:j, 0], sums[i:j, 1] = f.sum(1), g.sum(1)
        sums[i:j, 2] = a[i:j].exp().sum(1)
    sums = _gathered(sums, spec, "row sums").sum(0)
    metrics = {"student_mass": torch.ones_like(log_s), "teacher_mass": sums[:, 2]}
    return sums[:, 0], metrics, (m_max, log_s, sums[:, 1])


def full_backward(
    prod: Producer, a: torch.Tensor, saved: tuple[torch.Tensor, ...], gloss: torch.Tensor,
    spec: Spec,
) -> None:  # fmt: skip
    """``dz = (ḡ/τ)·(g − p·Σg)``, chunk by chunk."""
    m_max, log_s, total = saved
    scale = (gloss / spec.tau)[:, None]
    for i, j in spec.chunks(prod.rows, prod.v_local):
        b = _log_softmax(prod.logits(i, j), spec, m_max[i:j], log_s[i:j])
        g = terms(spec.kind, a[i:j], b, spec.beta, spec.clamp)[1]
        dz = g.sub_(b.exp_().mul_(total[i:j, None])).mul_(scale[i:j])
        prod.add_grad(i, j, dz)
