"""Context-parallel reverse scans that exchange only carries (docs/design/context-parallel.md).

A scan is linear in what enters a chunk from its right, so each rank scans its chunks with
nothing entering and summarises each by ``(local[0], G[0])``:

    y_chunk[t] = local[t] + G[t] * Y_in,      G[t] = a[t] * a[t+1] * ... * a[end]

One ``all_gather`` of the summaries (five numbers per chunk and row for GAE, whose advantage
also depends on the value entering), the chunk recurrence ``Y_k = local_k[0] + G_k[0] * Y_{k+1}``
solved on every rank, and each rank fixes its own chunks. The exchange is a checked group call
(:func:`rlops.distributed.collectives.gather`, docs/design/group-calls.md).
"""

from __future__ import annotations

import torch

from rlops._types import CPLayout
from rlops.advantages._masking import (
    GaeInputs,
    enter,
    pass_through_decay,
    shift_in,
    td_residual,
    token_decay,
)
from rlops.distributed import collectives
from rlops.distributed.collectives import Call
from rlops.distributed.groups import group_rank_size
from rlops.distributed.layout import check_cp_layout, rank_chunks
from rlops.scan import is_per_token, scan
from rlops.scan.decay import decayed
from rlops.scan.reference import scan_reference

__all__ = ["Layout", "cp_gae", "cp_reinforce_returns", "cp_scan"]

#: this family's own switch of the consistency check (besides ``RLOPS_GROUP_CHECK``)
ENV = "RLOPS_CP_CHECK"
_CHECKSUM = " (per-row checksum)"


class Layout:
    """This rank's place in a context-parallel layout: its chunks (``pieces``, in local
    order), how the gathered summaries are put in global chunk order, and whether its last
    piece ends the row."""

    def __init__(self, group, layout: CPLayout = "zigzag"):
        self.name = check_cp_layout(layout)
        self.group = group
        self.rank, self.world = group_rank_size(group, "cp_group")
        self.chunks = rank_chunks(layout, self.world, self.rank)
        self.p = len(self.chunks)
        self.n_chunks = self.p * self.world
        self.holds_end = self.chunks[-1] == self.n_chunks - 1
        # gathered rows are (rank, piece); chunk c sits at row owner[c]
        owner = [0] * self.n_chunks
        for rank in range(self.world):
            for j, c in enumerate(rank_chunks(layout, self.world, rank)):
                owner[c] = rank * self.p + j
        self.owner = owner

    def pieces(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, p*L]`` (this rank's chunks side by side) -> ``[p*N, L]``, piece-major."""
        n, t_local = x.shape
        if t_local % self.p:
            raise ValueError(
                "context-parallel inputs must hold this rank's two zigzag chunks of equal length "
                f"(an even local length), got {t_local}"
            )
        if self.p == 1:
            return x
        return x.reshape(n, self.p, t_local // self.p).transpose(0, 1).reshape(self.p * n, -1)

    def unpieces(self, y: torch.Tensor, n: int) -> torch.Tensor:
        if self.p == 1:
            return y
        return y.reshape(self.p, n, -1).transpose(0, 1).reshape(n, -1)

    def rows(self, v: torch.Tensor) -> torch.Tensor:
        """A per-row ``[N]`` or ``[N, 1]`` tensor repeated for every piece: ``[p*N, 1]``."""
        return v.reshape(-1, 1).repeat(self.p, 1)

    def end_tail(self, end: torch.Tensor | None, n: int, like: torch.Tensor):
        """What enters each piece from its right before the exchange, ``[p*N]``: the row's end
        value ``end`` on the piece that ends the row (on the rank holding it), else 0; None
        when nothing enters anywhere on this rank."""
        if end is None or not self.holds_end:
            return None
        zero = like.new_zeros(((self.p - 1) * n,))
        return torch.cat([zero, end.to(like.dtype).reshape(n)])

    def order(self, gathered: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        """``[world, p*N, k]`` gathered summaries -> ``[N, n_chunks, k]`` in chunk order."""
        flat = gathered.reshape(self.world * self.p, rows, k)
        ordered = flat[torch.tensor(self.owner, device=flat.device)]
        return ordered.transpose(0, 1)

    def own(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunks' entries of a ``[N, n_chunks]`` tensor, as ``[p*N]``."""
        return torch.cat([per_chunk[:, c] for c in self.chunks])


def _solve(head: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Chunk carries ``Y_k = head_k + decay_k * Y_{k+1}``, ``[N, C]``; returns ``Y_{k+1}``
    (what enters chunk k from the right). C steps: independent of T."""
    y = scan_reference(head, decay)
    return shift_in(y, None)


def _checksum(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One float64 number that differs when a per-row parameter differs (a weighted sum, so a
    permutation of rows shows too), 0-dim on the device: no host read."""
    v = value.detach().to(device=device, dtype=torch.float64).reshape(-1)
    w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=device)
    return (v * w).sum() + 0.5 * v.sum()


def _parameter(name: str, value: float | torch.Tensor | None, device: torch.device) -> dict:
    """A parameter that must agree across ranks, as a field of the call's description: a number
    as it is (shown in errors), a tensor by its checksum (compared on the device)."""
    if isinstance(value, torch.Tensor):
        return {name + _CHECKSUM: _checksum(value, device)}
    return {name: None if value is None else float(value)}


def _describe(
    op: str, summary: torch.Tensor, t_local: int, method: str, layout: Layout, **fields
) -> Call:
    """What this rank was asked to do: everything that must agree across ``cp_group``. A
    checksum differs with the rows and the dtype: where those differ, it is not reported."""
    checksums = tuple(k for k in fields if k.endswith(_CHECKSUM))
    return Call(
        op,
        implied={
            "rows": checksums,
            "dtype": checksums,
            "discount form": ("discount", "discount" + _CHECKSUM),
            "bootstrap": ("bootstrap" + _CHECKSUM,),
        },
        cp_layout=layout.name,
        rows=summary.shape[0] // layout.p,
        **{"local length": t_local},
        dtype=summary.dtype,
        method=method,
        **fields,
    )


def _gather(summary: torch.Tensor, layout: Layout, call: Call) -> torch.Tensor:
    """All chunks' summaries in global chunk order, ``[N, n_chunks, k]``, from this rank's
    ``[p*N, k]`` (its pieces): one ``collectives.gather``, which checks ``call`` first
    (module docstring)."""
    check = collectives.check_enabled(ENV)
    gathered = collectives.gather(summary, layout.group, call, "cp_group", check=check)
    gathered = gathered.to(summary.dtype)  # float64 on the wire: exact for float32 too
    rows, k = summary.shape
    return layout.order(gathered, rows // layout.p, k)


def cp_scan(
    x: torch.Tensor,
    decay: float | torch.Tensor,
    layout: Layout,
    method: str,
    chunk_size=None,
    params: tuple | None = None,
) -> torch.Tensor:
    """Reverse scan of shards ``x`` ``[N, T_local]``; ``decay`` float / ``[N,1]`` / ``[N,T_local]``.

    ``params`` are the per-row parameters of a caller that built a per-token ``decay`` from
    them (``discounted_returns`` passes ``(gamma, bootstrap fields)``): the call is then
    described as ``discounted_returns`` with its ``gamma``, else as ``discounted_cumsum`` with
    its discount.
    """
    n, t_local = x.shape
    xp = layout.pieces(x)
    ap: float | torch.Tensor
    # a local length of 1 (the contiguous layout allows it) cannot tell one decay per token
    # from one per row: it is taken as data, not compared across ranks
    if isinstance(decay, torch.Tensor) and (is_per_token(decay, t_local) or t_local == 1):
        form = "per token"
        ap = layout.pieces(decay.expand(n, t_local))
    elif isinstance(decay, torch.Tensor):
        form = "per row"
        ap = layout.rows(decay)
    else:
        form = "scalar"
        ap = decay
    a_full = torch.as_tensor(ap, dtype=xp.dtype, device=xp.device).expand_as(xp)
    rows = ap.repeat(2, 1) if isinstance(ap, torch.Tensor) else ap
    yy = scan(torch.cat([xp, _last(a_full)]), rows, method, chunk_size)
    m = xp.shape[0]
    local, g = yy[:m], yy[m:]  # local scan; product of decays to the chunk end
    summary = torch.stack([local[:, 0], g[:, 0]], -1)
    fields: dict[str, object]
    if params is None:  # the discount must agree, unless it is per token (data)
        op = "discounted_cumsum"
        fields = {"discount form": form}
        if form != "per token":
            fields |= _parameter("discount", decay, x.device)
    else:
        op = "discounted_returns"
        fields = _parameter("gamma", params[0], x.device) | params[1]
    chunks = _gather(summary, layout, _describe(op, summary, t_local, method, layout, **fields))
    y_in = _solve(chunks[..., 0], chunks[..., 1])  # [N, C]
    y = local + decayed(g, layout.own(y_in).unsqueeze(-1))
    return layout.unpieces(y, n)


def bootstrap_fields(end: torch.Tensor | None, cut: torch.Tensor | None, device) -> dict:
    """The bootstrap's part of a call's description: its form, and a per-row value's checksum
    (every rank passes the same ``[B]``; the rank holding the row's end reads it)."""
    if end is not None:
        return {"bootstrap": "per row"} | _parameter("bootstrap", end, device)
    return {"bootstrap": "per token" if cut is not None else None}


def cp_gae(x: GaeInputs, layout: Layout, method, chunk_size=None):
    """GAE on shards: :class:`~rlops.advantages._masking.GaeInputs` of ``[N, T_local]`` shards,
    ``end`` the value entering at the row's end (read on the rank that holds it). Returns
    ``(advantages, returns)`` shards (values are required: returns run :func:`cp_scan`)."""
    r, v, mask, dones, cut, end = x.rewards, x.values, x.mask, x.dones, x.cut, x.end
    gamma, gamma_lam = x.rows()
    assert v is not None
    n, t_local = r.shape
    rp, vp = layout.pieces(r), layout.pieces(v)
    m = torch.ones_like(rp, dtype=torch.bool) if mask is None else layout.pieces(mask)
    d = None if dones is None else layout.pieces(dones)
    cp_ = None if cut is None else layout.pieces(cut)
    tail = layout.end_tail(end, n, rp)
    keep = torch.ones_like(m) if d is None else ~d
    g, gl = layout.rows(gamma), layout.rows(gamma_lam)
    mp = m.shape[0]
    # 1. value of the next action token: z[t] = V at the first action at or after t (the
    #    cut value at a mask-0 end, the row's end value entering on the last piece)
    a_z = pass_through_decay(m, d, rp.dtype)
    x_z = torch.where(m, vp, 0.0 if cp_ is None else cp_)
    x_z = x_z if tail is None else enter(x_z, a_z, tail)
    zz = scan(torch.cat([x_z, _last(a_z)]), a_z.repeat(2, 1), method, chunk_size)
    z, gz = zz[:mp], zz[mp:]  # local values; pass-through product to the chunk end
    nxt_local = torch.where(keep, shift_in(z, tail), 0.0 if cp_ is None else cp_)
    nxt_coef = torch.where(keep & m, g * shift_in(gz, 1.0), 0.0)
    # 2. advantages: local part, response to the value entering, product to the chunk end
    a_adv = token_decay(gl, m, d, rp)
    delta = td_residual(rp, vp, nxt_local, g, m)
    aa = scan(torch.cat([delta, nxt_coef, _last(a_adv)]), a_adv.repeat(3, 1), method, chunk_size)
    adv, s, ga = aa[:mp], aa[mp : 2 * mp], aa[2 * mp :]
    summary = torch.stack([z[:, 0], gz[:, 0], adv[:, 0], s[:, 0], ga[:, 0]], -1)
    fields = _parameter("gamma", gamma, r.device) | _parameter("gamma * lam", gamma_lam, r.device)
    fields |= bootstrap_fields(end, cut, r.device)
    c = _gather(summary, layout, _describe("gae", summary, t_local, method, layout, **fields))
    z_in = _solve(c[..., 0], c[..., 1])  # value entering each chunk
    head_adv = c[..., 2] + decayed(c[..., 3], z_in)
    a_in = _solve(head_adv, c[..., 4])  # advantage entering each chunk
    adv = adv + decayed(s, layout.own(z_in).unsqueeze(-1))
    adv = adv + decayed(ga, layout.own(a_in).unsqueeze(-1))
    adv = torch.where(m, adv, 0.0)
    ret = torch.where(m, vp + adv, 0.0)
    return layout.unpieces(adv, n), layout.unpieces(ret, n)


def _last(a: torch.Tensor) -> torch.Tensor:
    """x for :func:`scan` whose result is the product of ``a`` from t to the row's end."""
    x = torch.zeros_like(a)
    x[:, -1] = a[:, -1]
    return x


def cp_reinforce_returns(
    token_rewards, outcome, mask, gamma, layout: Layout, method, kl_coef=None
):  # fmt: skip
    """REINFORCE++ returns on shards: discounted returns over action tokens of
    ``token_rewards`` ``[N, T_local]``, plus ``outcome`` ``[N]`` on the row's globally last
    action token (found from the per-chunk summaries, no extra collective)."""
    n, t_local = token_rewards.shape
    xp, m = layout.pieces(token_rewards), layout.pieces(mask)
    a = token_decay(layout.rows(gamma), m, None, xp)
    mp = m.shape[0]
    # one-hot on each chunk's last action token (if any)
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos, -1).amax(-1, keepdim=True)
    onehot = (pos == last).to(xp.dtype)
    yy = scan(torch.cat([torch.where(m, xp, 0.0), _last(a), onehot]), a.repeat(3, 1), method)
    y, g, u = yy[:mp], yy[mp : 2 * mp], yy[2 * mp :]
    has = m.any(-1).to(xp.dtype)
    summary = torch.stack([y[:, 0], g[:, 0], u[:, 0], has], -1)
    fields = _parameter("gamma", gamma, xp.device) | _parameter("kl_coef", kl_coef, xp.device)
    call = _describe("reinforce_plus_plus_returns", summary, t_local, method, layout, **fields)
    c = _gather(summary, layout, call)
    # the globally last chunk holding an action token gets the outcome
    k = torch.arange(c.shape[1], device=c.device)
    k_last = torch.where(c[..., 3] > 0, k, -1).amax(-1, keepdim=True)  # [N, 1]
    hit = (k == k_last).to(xp.dtype) * outcome.reshape(n, 1).to(xp.dtype)  # [N, C]
    y_in = _solve(c[..., 0] + hit * c[..., 2], c[..., 1])
    y = y + decayed(g, layout.own(y_in).unsqueeze(-1)) + u * layout.own(hit).unsqueeze(-1)
    return layout.unpieces(torch.where(m, y, 0.0), n)
