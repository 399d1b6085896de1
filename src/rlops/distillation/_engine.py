"""The chunk loops of the distillation ops: per-row statistics of the student's softmax and the
teacher's buckets in the forward, each chunk's logit gradient in the backward.

A *producer* gives rows ``i:j`` of the (local shard's) logits in the compute dtype and takes
their gradient; the op on logits slices them, the fused output layer multiplies. Top-k teacher:
one ``gather`` of ``[N, 3 + 2k]`` statistics per call (local max, softmax sum, tail sum, the
student's logits at the teacher's ids, the local top-k); full teacher, forward or reverse KL
without the clamp: one gather of ``[N, 4]`` per-shard sums; JSD or the clamp: the
log-normaliser's statistics, then the rows' sums (two). The backward reads only what the
forward saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlops._types import Group
from rlops.distillation._buckets import log1mexp, terms
from rlops.distributed.collectives import Call, gather

# Elements of one ``[C, V]`` temporary of the chunk loops (16 MiB of float32).
CHUNK_ELEMENTS = 1 << 22
# Columns of one block of the student's top-k search (:func:`_top`).
BLOCK = 8


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

    def chunks(self, prod: Producer) -> list[tuple[int, int]]:
        n = prod.rows
        if torch.compiler.is_compiling() or n == 0:
            return [(0, n)]
        step = max(1, CHUNK_ELEMENTS // max(prod.v_local, 1))
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


def _width(v: int) -> int:
    """Columns per block of the element-wise loops: at most 64 blocks of whole 64-column steps,
    at least 512 columns, from the shard's width alone; a block of a chunk stays in L2."""
    return max(512, -(-v // 4096) * 64)


def _exp_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``Σ_j e^{x_j − m}`` ``[C]`` of ``x [C, V]`` (overwritten with ``e^{x − m}``), block by
    block of columns: each block read once, while in cache."""
    total = x.new_zeros(x.shape[0])
    width = _width(x.shape[1])
    for v0 in range(0, x.shape[1], width):
        total += x[:, v0 : v0 + width].sub_(m).exp_().sum(1)
    return total


def _shifted_exp(
    x: torch.Tensor, shifts: tuple[torch.Tensor, ...], c: torch.Tensor
) -> torch.Tensor:
    """``x ← e^{x − s₁ − s₂ …}·c`` in place (``sᵢ``, ``c`` ``[C, 1]``; the shifts subtracted one
    after the other), block by block of columns (each block in cache for all of it)."""
    width = _width(x.shape[1])
    for v0 in range(0, x.shape[1], width):
        xb = x[:, v0 : v0 + width]
        for t in shifts:
            xb.sub_(t)
        xb.exp_().mul_(c)
    return x


def top_values(x: torch.Tensor, kk: int) -> torch.Tensor:
    """The ``kk`` largest values of each row of ``x [C, V]`` (a multiset, unsorted), exactly:
    :func:`_top`'s values."""
    return _top(x, kk)[0]


def _top(x: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, columns)`` of the ``kk`` largest entries of each row of ``x [C, n]``.

    The columns fall in ``m`` strided blocks of :data:`BLOCK` (block ``j``: columns
    ``j, j + m, …``); the ``kk`` blocks with the largest maxima (found the same way, from the
    ``[C, m]`` maxima) hold ``kk`` values at least as large as any value outside them, so the
    top ``kk`` of those blocks and of the ``n mod B`` columns left over are the row's:
    ``topk`` reads ``kk·B`` values a row at each level instead of ``n``."""
    c, n = x.shape
    m = n // BLOCK
    if m < 2 * kk or torch.compiler.is_compiling():
        top = x.topk(kk, dim=1, sorted=False)
        return top.values, top.indices
    blocks = x[:, : m * BLOCK].view(c, BLOCK, m)
    pick = _top(blocks.amax(1), kk)[1][:, None, :]  # [C, 1, kk]
    cand = blocks.gather(2, pick.expand(c, BLOCK, kk)).reshape(c, BLOCK * kk)
    cols = (pick + m * torch.arange(BLOCK, device=x.device)[:, None]).reshape(c, BLOCK * kk)
    if m * BLOCK < n:
        cand = torch.cat([cand, x[:, m * BLOCK :]], 1)
        cols = torch.cat([cols, torch.arange(m * BLOCK, n, device=x.device).expand(c, -1)], 1)
    top = cand.topk(kk, dim=1, sorted=False)
    return top.values, cols.gather(1, top.indices)


def topk_forward(
    prod: Producer, a: torch.Tensor, ids: torch.Tensor, spec: Spec
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Top-k teacher: ``(loss [N], metrics, saved)``; ``a``, ``ids``: ``[N, k]``."""
    n, k, v = prod.rows, ids.shape[1], prod.v_local
    tail = spec.tail and k < spec.vocab
    kk = min(k, v)
    stats = a.new_empty((n, 3 + 2 * k))
    for i, j in spec.chunks(prod):
        x = _scaled(prod.logits(i, j), spec)
        col, inside = _local_ids(ids[i:j], spec, v)
        xk = x.gather(1, col)
        stats[i:j, 3 : 3 + k] = torch.where(inside, xk, 0.0)
        top = top_values(x, kk)
        stats[i:j, 3 + k : 3 + k + kk] = top
        stats[i:j, 3 + k + kk :] = -torch.inf
        m = top.amax(1, keepdim=True)  # the row's max is among its top-k
        stats[i:j, 0] = m[:, 0]
        if tail:  # the tail's own sum, never ``1 − Σ_K``: K's logits made -inf, their e^x 0
            x.scatter_add_(1, col, x.new_zeros(col.shape).masked_fill_(inside, -torch.inf))
        rest = _exp_sum(x, m)
        stats[i:j, 2] = rest
        stats[i:j, 1] = rest + torch.where(inside, (xk - m).exp(), 0.0).sum(1) if tail else rest
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
    k, v = ids.shape[1], prod.v_local
    gs = g * (gloss / spec.tau)[:, None]  # the upstream gradient and 1/τ folded in
    total = gs.sum(1, keepdim=True)
    tail = g.shape[1] > k
    scale = -total * (-log_s).exp()[:, None]
    for i, j in spec.chunks(prod):
        x = _scaled(prod.logits(i, j), spec)
        col, inside = _local_ids(ids[i:j], spec, v)
        m = m_max[i:j, None]
        if not tail:  # −p·Σg = e^{x − m}·(−Σg/S)
            dz = _shifted_exp(x, (m,), scale[i:j])
            dz.scatter_add_(1, col, torch.where(inside, gs[i:j, :k], 0.0))
        elif spec.world == 1:  # off K: p·(g_tail/P_tail − Σg) = e^{x − log T}·(g_tail − Σg·P_tail)
            p_k = ((x.gather(1, col) - m) - log_s[i:j, None]).exp()
            c = gs[i:j, k:] - total[i:j] * (log_tail[i:j] - log_s[i:j]).exp()[:, None]
            dz = _shifted_exp(x, (m, log_tail[i:j, None]), c)
            dz.scatter_(1, col, gs[i:j, :k] - p_k * total[i:j])  # K: written, never cancelled
        else:  # ids of other shards: e^{x − log T} zeroed on K exactly (x − inf)
            x.sub_(m)
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


def one_gather(spec: Spec) -> bool:
    """Whether a full teacher's forward takes one gather: the divergence splits into per-shard
    sums (forward/reverse KL without the clamp); the JSD's mixture and the clamp put the
    log-normaliser inside a nonlinearity, and take two."""
    return spec.kind != "jsd" and spec.clamp is None


def full_forward(
    prod: Producer, a: torch.Tensor, spec: Spec
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Full teacher (``a``: ``[N, V_local]``): ``(loss [N], metrics, saved)``."""
    if one_gather(spec):
        return _full_kl_forward(prod, a, spec)
    n = prod.rows
    chunks = spec.chunks(prod)
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


def _full_kl_forward(
    prod: Producer, a: torch.Tensor, spec: Spec
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Forward or reverse KL of a full teacher in one pass and one gather. With ``y = z − m_r``
    (``m_r`` the shard's max), ``s_r = Σ e^y`` and ``L_r = lse − m_r ≥ 0`` once gathered::

        forward_kl = Σ_r [Σ p_t (a − y) + L_r·Σ p_t]
        reverse_kl = Σ_r (e^{m_r − M}/S)·[Σ e^y (y − a) − L_r·s_r]

    every term of the order of ``|log p_s|`` (no cancellation beyond the definition's);
    ``Σ ∂f/∂b`` is ``−Σ p_t`` (forward) or ``loss + 1`` (reverse, ``Σ p_s = 1``)."""
    n = prod.rows
    forward = spec.kind == "forward_kl"
    stats = a.new_empty((n, 4))  # m_r, s_r, the kind's local sum, Σ p_t
    for i, j in spec.chunks(prod):
        y = _scaled(prod.logits(i, j), spec)
        m = y.amax(1, keepdim=True)
        y, ai = y.sub_(m), a[i:j]
        p = ai.exp()
        stats[i:j, 3] = p.sum(1)
        if forward:
            stats[i:j, 2] = torch.where(p > 0, p * (ai - y), 0.0).sum(1)
            e = y.exp_()
        else:
            e = y.exp()
            stats[i:j, 2] = torch.where(e > 0, e * (y - ai), 0.0).sum(1)
        stats[i:j, 0], stats[i:j, 1] = m[:, 0], e.sum(1)
    rows = _gathered(stats, spec, "log-normaliser and sums")
    m_max = rows[:, :, 0].amax(0)
    w = (rows[:, :, 0] - m_max).exp()  # e^{m_r − M}, [world, N]
    s = (rows[:, :, 1] * w).sum(0)
    log_s = s.log()
    big_l = (m_max - rows[:, :, 0]) + log_s  # lse − m_r
    mass = rows[:, :, 3].sum(0)
    if forward:
        part = rows[:, :, 2] + big_l * rows[:, :, 3]
        loss = torch.where(rows[:, :, 3] > 0, part, 0.0).sum(0)
        total = -mass
    else:
        part = (w / s) * (rows[:, :, 2] - big_l * rows[:, :, 1])
        loss = torch.where(w > 0, part, 0.0).sum(0)
        total = loss + 1
    metrics = {"student_mass": torch.ones_like(log_s), "teacher_mass": mass}
    return loss, metrics, (m_max, log_s, total)


def full_backward(
    prod: Producer, a: torch.Tensor, saved: tuple[torch.Tensor, ...], gloss: torch.Tensor,
    spec: Spec,
) -> None:  # fmt: skip
    """``dz = (ḡ/τ)·(g − p·Σg)``, chunk by chunk."""
    m_max, log_s, total = saved
    scale = (gloss / spec.tau)[:, None]
    for i, j in spec.chunks(prod):
        b = _log_softmax(prod.logits(i, j), spec, m_max[i:j], log_s[i:j])
        g = terms(spec.kind, a[i:j], b, spec.beta, spec.clamp)[1]
        dz = g.sub_(b.exp_().mul_(total[i:j, None])).mul_(scale[i:j])
        prod.add_grad(i, j, dz)
