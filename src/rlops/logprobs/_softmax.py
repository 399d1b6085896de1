"""The softmax of one vocabulary shard: the head's map, per-shard statistics, their merge, the
local gradient.

The head maps the logits ``x`` to ``z = c·tanh(s·x / c) / τ`` (:class:`Head`). A chunk of
``z`` ``[C, V_local]`` reduces to the columns of :func:`stats_chunk`: the target logit (0 off
the shard), the max ``m`` and ``s = Σ exp(z − m)`` of the log-prob distribution, with entropy
the shard's own ``h`` (of all logits, with ``(m, s)`` again, when a support masks the
log-prob's), and last the shard's ``ρ = Σ p²``. :func:`merge` combines the shards exactly
(``docs/design/logprobs.md``); the backward (:func:`grad_chunk`) is local to each shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# Clamp of (z − max) in entropy terms so that a -inf logit (probability 0) contributes 0 · finite
# instead of 0 · inf = NaN. exp(−1e30) is exactly 0 in every float type, so nothing else changes.
_FLOOR = -1e30


def n_columns(masked: bool, entropy: bool, squares: bool = False) -> int:
    """Statistics per token: 3 for the log-prob, 0 more (no mask) or 3 more (mask) for entropy,
    1 more for the sum of squares (the last column)."""
    return 3 + (3 if masked else 1) * entropy + squares


def target_index(
    target: torch.Tensor, start: int, v_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([C, 1] column index clamped into the shard, [C, 1] bool: target in this shard)``."""
    local = target.unsqueeze(1) - start
    in_range = (local >= 0) & (local < v_local)
    return local.clamp(0, v_local - 1), in_range


def _softmax_stats(
    z: torch.Tensor, own: bool, entropy: bool, squares: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Row max ``m``, ``s = Σ exp(z − m)``, optionally the row entropy ``h`` and the row's
    ``ρ = Σ p²`` (:func:`_squares_ratio`); may reuse ``z``."""
    m = z.amax(dim=-1, keepdim=True)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # an all -inf row: s = 0
    d = z.sub_(m_safe) if own else z - m_safe
    if not entropy:
        e = d.exp_()
        s = e.sum(dim=-1, keepdim=True)
        return m, s, None, (_squares_ratio(e, s) if squares else None)
    d.clamp_(min=_FLOOR)
    e = d.exp()
    s = e.sum(dim=-1, keepdim=True)
    u = torch.linalg.vecdot(e, d).unsqueeze(1)  # Σ e·(z − m) ≤ 0
    return m, s, s.log() - u / s, (_squares_ratio(e, s) if squares else None)


def wide_dtype(device: torch.device) -> torch.dtype:
    """float64, but float32 where the device has no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _squares_ratio(e: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[C, 1]`` ``Σ_v p_v²`` with ``p = e / s`` (``e`` ``[C, V]`` ``≥ 0``, ``s`` its row
    sums ``[C, 1]``), as the softmax computes ``p``: the same roundings as the reference, and
    no more passes than a division and a dot product (float64 sums cost several times the
    chunk's other work on CPU). Overwrites ``e``; 0 for a row of zeros."""
    p = e.div_(torch.where(s > 0, s, torch.ones_like(s)))
    return torch.linalg.vecdot(p, p).unsqueeze(1)


def stats_chunk(
    z: torch.Tensor,
    own: bool,
    idx: torch.Tensor,
    in_range: torch.Tensor,
    keep: torch.Tensor | None,
    *,
    entropy: bool,
    out: torch.Tensor,
    squares: bool = False,
) -> None:
    """Write the statistics of one chunk of scaled logits ``z`` ``[C, V]`` into ``out`` ``[C, k]``.

    ``own``: ``z`` is a temporary that may be overwritten. ``keep``: the chunk's keep mask.
    ``squares``: also ``ρ``, the log-prob distribution's ``Σ p²`` within the chunk (last).
    """
    zy = z.gather(1, idx)
    out[:, 0:1] = torch.where(in_range, zy, torch.zeros_like(zy))
    c = n_columns(keep is not None, entropy)
    if keep is None:
        m, s, h, w = _softmax_stats(z, own, entropy, squares)
        out[:, 1:2], out[:, 2:3] = m, s
        if h is not None:
            out[:, 3:4] = h
        if w is not None:
            out[:, c : c + 1] = w
        return
    # The kept distribution first, on one buffer of the chunk's size (``z`` itself when it is
    # ours and the entropy does not need it after); that buffer is dropped before the entropy's
    # statistics take theirs, so a support costs no more chunk buffers than the call without.
    ninf = z.new_full((), float("-inf"))
    zk = torch.where(keep, z, ninf, out=z) if own and not entropy else torch.where(keep, z, ninf)
    zk.scatter_(1, idx, torch.where(in_range, zy, zk.gather(1, idx)))  # the target is always kept
    mk, sk, _, wk = _softmax_stats(zk, True, False, squares)
    del zk
    out[:, 1:2], out[:, 2:3] = mk, sk
    if wk is not None:
        out[:, c : c + 1] = wk
    if entropy:
        m, s, h, _ = _softmax_stats(z, own, True)
        assert h is not None
        out[:, 3:4], out[:, 4:5], out[:, 5:6] = m, s, h


def _merge_lse(m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[R, N]`` per-shard ``(m, s)`` → ``(M, log S, q)``, ``q`` the shards' probability masses."""
    big_m = m.amax(dim=0)
    w = torch.exp(m - big_m) * s
    total = w.sum(dim=0)
    return big_m, total.log(), w / total


def merge(
    gathered: torch.Tensor, masked: bool, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Merge ``[R, N, k]`` per-shard statistics into ``(logp [N], H [N] or None, saved)``.

    ``saved`` is ``(M, log S)`` of the log-prob distribution, then, with entropy,
    ``(M, log S, H)`` of the unmasked distribution (each ``[N]``).
    """
    zy = gathered[:, :, 0].sum(dim=0)  # exactly one shard holds a non-zero target logit
    mp, lsp, q = _merge_lse(gathered[:, :, 1], gathered[:, :, 2])
    logp = (zy - mp) - lsp
    if not entropy:
        return logp, None, (mp, lsp)
    c = 3 if masked else 1
    m, s, h = gathered[:, :, c], gathered[:, :, c + 1], gathered[:, :, c + 2]
    if masked:
        me, lse, q = _merge_lse(m, s)
    else:
        me, lse = mp, lsp
    terms = q * (h + (me - m) + (lse - s.log()))
    # a shard holding none of the distribution (q = 0) adds 0; a NaN (q or h) stays NaN
    ent = torch.where(q == 0, torch.zeros_like(terms), terms).sum(dim=0)
    return logp, ent, (mp, lsp, me, lse, ent)


def merge_squares(
    gathered: torch.Tensor, masked: bool, entropy: bool, saved: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """``[N]`` ``Σ_v p_v² = Σ_r q_r² · ρ_r`` of the log-prob distribution from the ``[R, N, k]``
    statistics (``ρ_r`` last) and :func:`merge`'s ``saved`` (its ``M``), in float64; a shard
    holding nothing of the distribution adds 0."""
    c = n_columns(masked, entropy)
    m, s, rho = (gathered[:, :, k].to(wide_dtype(gathered.device)) for k in (1, 2, c))
    w = torch.exp(m - saved[0].to(m.dtype)) * s
    q = w / w.sum(dim=0)
    return (q * q * rho).sum(dim=0).to(gathered.dtype)


def grad_chunk(
    z: torch.Tensor,
    own: bool,
    idx: torch.Tensor,
    in_range: torch.Tensor,
    keep: torch.Tensor | None,
    *,
    saved: Sequence[torch.Tensor],
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    inv_tau: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. the unscaled logits of one chunk ``[C, V]`` in ``z``'s dtype, from the
    chunk's rows of :func:`merge`'s ``saved`` and the upstream ``g_logp``, ``g_ent`` ``[C, 1]``
    (at least one); written into ``out`` when it has ``z``'s dtype."""
    grad = None
    dst = out if out is not None and out.dtype == z.dtype else None
    c_logp = None if g_logp is None else g_logp * (-inv_tau)
    mp, lsp = saved[0], saved[1]
    pk = None  # the kept distribution's p, the target always kept, 0 elsewhere
    spare = None  # a chunk buffer that is free once the entropy's terms are in ``grad``
    if keep is not None and c_logp is not None and g_ent is not None and own:
        # ``z`` is ours, and the entropy's log p is about to overwrite it: the kept p first
        pk = _kept_probs(z, idx, in_range, keep, mp, lsp)
    if g_ent is not None:
        me, lse, h = saved[2:5]
        d = z.sub_(me) if own else z.sub(me)
        d.sub_(lse)  # log p over the unmasked logits
        a = g_ent * (-inv_tau)
        b = a * h if (c_logp is None or keep is not None) else a * h + c_logp
        if pk is not None:  # p by column blocks: no third buffer of the chunk's size
            grad = _entropy_terms_by_columns(d, a, b)
        else:
            p = d.exp()
            d.clamp_(min=_FLOOR)
            d = torch.addcmul(b, d, a, out=d)
            grad = d.mul_(p) if dst is None else torch.mul(d, p, out=dst)  # p · (a·log p + b)
            spare = p
        if keep is None:
            c_logp = None  # already folded into b
    if c_logp is not None:  # − p · g_logp / τ, p over the kept logits
        if keep is None:
            p = (z.sub_(mp) if own else z - mp).sub_(lsp).exp_()
        elif pk is not None:
            p = pk
        else:
            p = _kept_probs(z, idx, in_range, keep, mp, lsp, into=z if own else spare)
        if grad is None:
            grad = p.mul_(c_logp) if dst is None else torch.mul(p, c_logp, out=dst)
        elif dst is not None and grad is not dst:  # the entropy's terms in ``z``'s buffer
            grad = torch.addcmul(grad, p, c_logp, out=dst)
        else:
            grad.addcmul_(p, c_logp)
    assert grad is not None, "grad_chunk needs g_logp or g_ent"
    if g_logp is not None:
        onehot = torch.where(in_range, g_logp * inv_tau, torch.zeros_like(g_logp))
        grad.scatter_add_(1, idx, onehot)
    return grad


def _plain_width(v: int) -> int:
    """Columns per block of :func:`plain_chunk` and :func:`plain_grad`: at most 64 blocks of
    whole 64-column steps, at least 512 columns, from the shard's width alone (a row's sums do
    not depend on how many rows share its chunk). A block of a default chunk stays in L2."""
    return max(512, -(-v // 4096) * 64)


def plain_chunk(
    z: torch.Tensor, idx: torch.Tensor, in_range: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """One process, every logit kept: ``(log p_y [C], H [C], state)`` of the scaled chunk ``z``
    ``[C, V]`` (overwritten with ``d = z − m``), ``state`` what :func:`plain_grad` needs
    (``d``, ``s = Σ e^d``, ``log s`` and ``H = log s − Σ e^d·d / s``). After the row max, each
    block of columns is read once while in cache: ``d``, ``e^d`` (a block's temporary) and both
    sums."""
    zy = z.gather(1, idx)
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # an all -inf row: s = 0
    s = z.new_zeros((z.shape[0], 1))
    ed = z.new_zeros((z.shape[0], 1))
    width = _plain_width(z.shape[1])
    for v0 in range(0, z.shape[1], width):
        d_b = z[:, v0 : v0 + width].sub_(m).clamp_(min=_FLOOR)
        e_b = d_b.exp()
        s += e_b.sum(dim=-1, keepdim=True)
        ed += torch.linalg.vecdot(e_b, d_b).unsqueeze(1)
    log_s = s.log()
    h = log_s - ed / s
    logp = torch.where(in_range, (zy - m) - log_s, torch.zeros_like(zy))
    return logp[:, 0], h[:, 0], (z, s, log_s, h)


def plain_grad(
    state: tuple[torch.Tensor, ...],
    idx: torch.Tensor,
    in_range: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    inv_tau: float | torch.Tensor,
) -> torch.Tensor:
    """The gradient w.r.t. the unscaled logits of :func:`plain_chunk`'s chunk from the upstream
    ``g_logp``, ``g_ent`` ``[C, 1]`` (None: 0): ``(p·(a·log p + b) + g·1_y)/τ`` with
    ``a = −g_H``, ``b = a·H − g``, written ``e^d·(a/s · d + (b − a·log s)/s)`` by blocks of
    columns (``e^d`` made again: cheaper than keeping it), in ``d`` (``e^d·b/s`` without an
    entropy gradient)."""
    d, s, log_s, h = state
    b = -g_logp * inv_tau
    a = None if g_ent is None else g_ent * (-inv_tau)
    b_s = b / s if a is None else (b + a * h - a * log_s) / s
    a_s = None if a is None else a / s
    width = _plain_width(d.shape[1])
    for v0 in range(0, d.shape[1], width):
        d_b = d[:, v0 : v0 + width]
        if a_s is None:
            d_b.exp_().mul_(b_s)
        else:
            e_b = d_b.exp()
            d_b.mul_(a_s).add_(b_s).mul_(e_b)
    onehot = torch.where(in_range, g_logp * inv_tau, torch.zeros_like(g_logp))
    return d.scatter_add_(1, idx, onehot)


def _kept_probs(
    z: torch.Tensor,
    idx: torch.Tensor,
    in_range: torch.Tensor,
    keep: torch.Tensor,
    mp: torch.Tensor,
    lsp: torch.Tensor,
    *,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[C, V]`` ``exp(z − mp − lsp)`` on the kept logits (the target always kept), 0
    elsewhere: the kept distribution's probabilities, written into ``into`` (``z`` itself, or
    a spare buffer of its shape; None: a new one)."""
    p = z - mp if into is None else torch.sub(z, mp, out=into)
    p.sub_(lsp).exp_()
    p_y = p.gather(1, idx)
    torch.where(keep, p, p.new_zeros(()), out=p)
    p.scatter_(1, idx, torch.where(in_range, p_y, p.gather(1, idx)))
    return p


def _entropy_terms_by_columns(d: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``d ← p · (a · log p + b)`` in place, ``d`` ``[C, V]`` holding ``log p``, ``p = exp(d)``
    (``a``, ``b`` ``[C, 1]``), by blocks of columns, so that ``p`` needs an eighth of ``d``'s
    size at a time rather than a buffer of its own (the kept distribution holds the other).
    The same operations as on the whole chunk."""
    v = d.shape[1]
    width = max(256, -(-v // 512) * 64)  # an eighth, in whole 64-column steps
    for v0 in range(0, v, width):
        dv = d[:, v0 : v0 + width]
        pv = dv.exp()
        dv.clamp_(min=_FLOOR)
        dv.copy_(torch.addcmul(b, dv, a).mul_(pv))  # no out= on a view (the compiler's rule)
    return d


def grad_differentiable(
    z: torch.Tensor,
    idx: torch.Tensor,
    keep: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    inv_tau: float | torch.Tensor,
) -> torch.Tensor:
    """:func:`grad_chunk` on one process's whole ``[N, V]`` with differentiable, out-of-place ops,
    ``lse`` and ``H`` recomputed from ``z`` so that their dependence on it is differentiated too
    (double backward)."""
    grad = torch.zeros_like(z)
    if g_ent is not None:
        log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
        p = log_p.exp()
        log_p = log_p.clamp(min=_FLOOR)  # a -inf logit: p = 0 and finite terms, as grad_chunk
        ent = -(p * log_p).sum(dim=-1, keepdim=True)
        grad = grad - (g_ent * inv_tau) * p * (log_p + ent)
    if g_logp is not None:
        onehot = torch.zeros_like(z, dtype=torch.bool).scatter_(1, idx, True)
        zk = z if keep is None else z.masked_fill(~(keep | onehot), float("-inf"))
        p_keep = (zk - torch.logsumexp(zk, dim=-1, keepdim=True)).exp()
        grad = grad + (g_logp * inv_tau) * (onehot.to(z.dtype) - p_keep)
    return grad


def pack_saved(saved: tuple[torch.Tensor, ...], masked: bool, entropy_grad: bool) -> tuple:
    """What the backward keeps of :func:`merge`'s ``saved``: 2, 3 or 5 tensors of ``[N]``.

    ``(M, log S)`` of the log-prob distribution; with an entropy gradient, also ``H``, and the
    unmasked ``(M, log S)`` when a keep mask makes the two distributions differ.
    """
    if len(saved) == 2 or not entropy_grad:
        return saved[:2]
    return saved if masked else (*saved[:2], saved[4])


def unpack_saved(saved: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], bool]:
    """Inverse of :func:`pack_saved`: ``([C, 1]``-shaped list for :func:`grad_chunk`, has H)."""
    cols = [t.unsqueeze(1) for t in saved]
    if len(cols) == 3:
        cols = [cols[0], cols[1], *cols]
    return cols, len(cols) == 5


@dataclass(frozen=True)
class Head:
    """The map ``x → z`` above: ``temperature`` τ (a float, or ``[C, 1]`` per row),
    ``logit_scale`` s, ``softcap`` c (None: off)."""

    temperature: float | torch.Tensor = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Only the temperature: ``z = x / τ``."""
        return self.logit_scale == 1.0 and self.softcap is None

    @property
    def tempered(self) -> bool:
        """Whether the map divides by τ (a per-row τ always does: its values are not read)."""
        return isinstance(self.temperature, torch.Tensor) or self.temperature != 1.0

    def rows(self, i: int, j: int) -> Head:
        """The map of rows ``i:j`` (a per-row τ sliced; a float τ: this map)."""
        if isinstance(self.temperature, torch.Tensor):
            return replace(self, temperature=self.temperature[i:j])
        return self

    @property
    def grad_scale(self) -> float | torch.Tensor:
        """``∂z/∂x`` where it is a constant (no softcap): ``s / τ`` (``1 / τ`` when ``s = 1``);
        with a softcap ``1 / τ``, the rest of the slope being :meth:`sloped`'s."""
        if self.logit_scale == 1.0 or self.softcap is not None:
            return 1.0 / self.temperature
        return self.logit_scale / self.temperature

    def scaled(self, x: torch.Tensor, dtype: torch.dtype, own: bool) -> tuple[torch.Tensor, bool]:
        """``(z in dtype, own)``; ``own`` (argument): ``x`` is a fresh buffer that may be
        overwritten; (result): ``z`` is one (not ``x``'s storage when ``x`` was not)."""
        if x.dtype != dtype:
            x, own = x.to(dtype), True
        tau = self.temperature
        if self.plain:
            if not self.tempered:
                return x, own
            return (x.div_(tau) if own else torch.div(x, tau)), True
        z = x if own else x.clone()
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.tempered:
            z.div_(tau)
        return z, True

    def sloped(
        self, x: torch.Tensor, dtype: torch.dtype, own: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With a softcap: ``(z, slope)``, ``z`` a fresh buffer with :meth:`scaled`'s bits and
        ``slope = s · (1 − tanh²(x·s / c))`` ``[C, V]`` (``τ · ∂z/∂x``)."""
        if self.softcap is None:
            raise ValueError("Head.sloped needs a softcap (else the slope is grad_scale)")
        t = x.to(dtype, copy=not own)
        if self.logit_scale != 1.0:
            t.mul_(self.logit_scale)
        t.div_(self.softcap).tanh_()
        z = t * self.softcap
        if self.tempered:
            z.div_(self.temperature)
        slope = t.mul_(t).neg_().add_(1.0)
        if self.logit_scale != 1.0:
            slope.mul_(self.logit_scale)
        return z, slope

    def differentiable(self, x: torch.Tensor) -> torch.Tensor:
        """``z`` from ``x`` (compute dtype) with out-of-place ops (a graph for double backward)."""
        z = x * self.logit_scale if self.logit_scale != 1.0 else x
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature
