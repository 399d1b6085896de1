"""Context-parallel reverse scans that exchange only carries.

Each rank holds two chunks of every sequence in the zigzag layout (chunks ``r`` and
``2*cp - 1 - r``, :mod:`rlops.distributed.zigzag`). A scan ``y[t] = x[t] + a[t] * y[t+1]`` is
linear in what enters a chunk from its right, so each chunk is scanned locally with nothing
entering, and summarised by a few numbers per row:

    y_chunk[t] = local[t] + G[t] * Y_in,      G[t] = a[t] * a[t+1] * ... * a[end]

The summaries ``(local[0], G[0])`` of all ``2*cp`` chunks are exchanged in **one**
``all_gather`` of ``O(cp)`` numbers per row (independent of T), every rank solves the tiny
chunk-level recurrence ``Y_k = local_k[0] + G_k[0] * Y_{k+1}`` for all chunks, and fixes its
own chunks with their ``Y_in``. GAE with masks and dones is two coupled scans (the value of
the next action token, then the advantage); by linearity the advantage's dependence on the
value entering from the right is one more local scan, so GAE also needs one collective with
five numbers per chunk and row.

Consistency check (on by default): the exchange is :func:`rlops.distributed.collectives.gather`
with a :class:`~rlops.distributed.collectives.Call` describing what the rank was asked to do:
the function (``gae``, ``discounted_returns``, ``discounted_cumsum``,
``reinforce_plus_plus_returns``), the rows, the local length, the compute dtype, the scan
method, the discount's form, the scalar parameters (``kl_coef``, a scalar discount) as numbers
and the per-row discounts (``gamma``, ``gamma * lam``, a per-row ``discount``) as device
checksums compared bit for bit. The description rides in the same fixed-size first exchange as
the summaries when they fit (64 numbers, of which the description takes 2 to 4: up to 6 GAE
rows, 7 REINFORCE++ rows, 15 scan rows per rank), so such a call makes one collective; larger
batches send the summaries in a second ``all_gather`` once the descriptions agree. Ranks that
make mismatched calls all raise the same ``ValueError`` naming each differing argument and
every rank's value, instead of hanging on buffers of different sizes or returning a result that
matches no rank's call. The check reads the digests on the host (a device synchronisation on
GPUs); ``RLOPS_CP_CHECK=0`` (these calls only) or ``RLOPS_GROUP_CHECK=0`` (every group check)
on every rank turns it off, leaving exactly one collective per call and no synchronisation.
Mask and dones are each rank's own data (an absent one means all action tokens / no episode end
there) and are not compared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops.advantages.masking import pass_through_decay, td_residual, token_decay
from rlops.distributed import collectives
from rlops.distributed.collectives import Call
from rlops.distributed.groups import group_rank_size
from rlops.scan import is_per_token, scan
from rlops.scan.decay import through
from rlops.scan.reference import scan_reference

__all__ = ["cp_gae", "cp_reinforce_returns", "cp_scan"]

#: this family's own switch of the consistency check (besides ``RLOPS_GROUP_CHECK``)
ENV = "RLOPS_CP_CHECK"
_CHECKSUM = " (per-row checksum)"


def _pieces(x: torch.Tensor) -> torch.Tensor:
    """``[N, 2L]`` (two chunks per row) -> ``[2N, L]``: rows of chunk r, then chunk 2cp-1-r."""
    n, t_local = x.shape
    if t_local % 2:
        raise ValueError(
            "context-parallel inputs must hold this rank's two zigzag chunks of equal length "
            f"(an even local length), got {t_local}"
        )
    return x.reshape(n, 2, t_local // 2).transpose(0, 1).reshape(2 * n, t_local // 2)


def _unpieces(y: torch.Tensor, n: int) -> torch.Tensor:
    return y.reshape(2, n, -1).transpose(0, 1).reshape(n, -1)


def _solve(head: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Chunk carries ``Y_k = head_k + decay_k * Y_{k+1}``, ``[N, 2cp]``; returns ``Y_{k+1}``
    (what enters chunk k from the right). 2cp steps: independent of T."""
    y = scan_reference(head, decay)
    return F.pad(y[:, 1:], (0, 1))


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


def _describe(op: str, summary: torch.Tensor, t_local: int, method: str, **fields) -> Call:
    """What this rank was asked to do: everything that must agree across ``cp_group``. A
    checksum differs with the rows and the dtype: where those differ, it is not reported."""
    checksums = tuple(k for k in fields if k.endswith(_CHECKSUM))
    return Call(
        op,
        implied={
            "rows": checksums,
            "dtype": checksums,
            "discount form": ("discount", "discount" + _CHECKSUM),
        },
        rows=summary.shape[0] // 2,
        **{"local length": t_local},
        dtype=summary.dtype,
        method=method,
        **fields,
    )


def _gather(summary: torch.Tensor, group, call: Call) -> torch.Tensor:
    """All chunks' summaries in global chunk order, ``[N, 2cp, k]``, from this rank's
    ``[2N, k]`` (its two chunks): one ``collectives.gather``, which checks ``call`` first
    (module docstring)."""
    check = collectives.check_enabled(ENV)
    gathered = collectives.gather(summary, group, call, "cp_group", check=check)
    gathered = gathered.to(summary.dtype)  # float64 on the wire: exact for float32 too
    cp = gathered.shape[0]
    rows, k = summary.shape
    per_rank = gathered.reshape(cp, 2, rows // 2, k)  # [rank, piece, row, k]
    # chunk c is piece 0 of rank c (c < cp), else piece 1 of rank 2cp-1-c
    ordered = torch.cat([per_rank[:, 0], per_rank[:, 1].flip(0)], dim=0)  # [2cp, n, k]
    return ordered.transpose(0, 1)


def cp_scan(
    x: torch.Tensor,
    decay: float | torch.Tensor,
    group,
    method: str,
    chunk_size=None,
    params: tuple | None = None,
) -> torch.Tensor:
    """Reverse scan of zigzag shards ``x`` ``[N, 2L]``; ``decay`` float / ``[N,1]`` / ``[N,2L]``.

    ``params`` are the per-row parameters of a caller that built a per-token ``decay`` from
    them (``discounted_returns`` passes ``(gamma, None)``): the call is then described as
    ``discounted_returns`` with its ``gamma``, else as ``discounted_cumsum`` with its discount.
    """
    group_rank_size(group, "cp_group")
    n, t_local = x.shape
    xp = _pieces(x)
    ap: float | torch.Tensor
    if isinstance(decay, torch.Tensor) and is_per_token(decay, t_local):
        form = "per token"
        ap = _pieces(decay.expand(n, t_local))
    elif isinstance(decay, torch.Tensor):
        form = "per row"
        ap = decay.reshape(n, 1).repeat(2, 1)
    else:
        form = "scalar"
        ap = decay
    a_full = torch.as_tensor(ap, dtype=xp.dtype, device=xp.device).expand_as(xp)
    rows = ap.repeat(2, 1) if isinstance(ap, torch.Tensor) else ap
    yy = scan(torch.cat([xp, _last(a_full)]), rows, method, chunk_size)
    local, g = yy[: 2 * n], yy[2 * n :]  # local scan; product of decays to the chunk end
    summary = torch.stack([local[:, 0], g[:, 0]], -1)
    fields: dict[str, object]
    if params is None:  # the discount must agree, unless it is per token (data)
        op = "discounted_cumsum"
        fields = {"discount form": form}
        if form != "per token":
            fields |= _parameter("discount", decay, x.device)
    else:
        op = "discounted_returns"
        fields = _parameter("gamma", params[0], x.device)
    chunks = _gather(summary, group, _describe(op, summary, t_local, method, **fields))
    y_in = _solve(chunks[..., 0], chunks[..., 1])  # [N, 2cp]
    y = local + through(g, _own(y_in, group).unsqueeze(-1))
    return _unpieces(y, n)


def _own(per_chunk: torch.Tensor, group) -> torch.Tensor:
    """This rank's two chunks' entries of a ``[N, 2cp]`` tensor, as ``[2N]`` (piece order)."""
    rank, cp = group_rank_size(group, "cp_group")
    return torch.cat([per_chunk[:, rank], per_chunk[:, 2 * cp - 1 - rank]])


def cp_gae(r, v, mask, dones, gamma, gamma_lam, group, method, chunk_size=None):
    """GAE on zigzag shards ``[N, 2L]``; ``mask``/``dones`` bool or None; ``gamma``,
    ``gamma_lam`` ``[N]``. Returns ``(advantages, returns)`` shards."""
    group_rank_size(group, "cp_group")
    n, t_local = r.shape
    rp, vp = _pieces(r), _pieces(v)
    m = torch.ones_like(rp, dtype=torch.bool) if mask is None else _pieces(mask)
    d = None if dones is None else _pieces(dones)
    keep = torch.ones_like(m) if d is None else ~d
    g = gamma.reshape(n, 1).repeat(2, 1)
    gl = gamma_lam.reshape(n, 1).repeat(2, 1)
    # 1. value of the next action token: z[t] = V at the first action at or after t
    a_z = pass_through_decay(m, d, rp.dtype)
    zz = scan(
        torch.cat([torch.where(m, vp, 0.0), _last(a_z)]), a_z.repeat(2, 1), method, chunk_size
    )
    z, gz = zz[: 2 * n], zz[2 * n :]  # local values; pass-through product to the chunk end
    nxt_local = torch.where(keep, F.pad(z[:, 1:], (0, 1)), 0.0)
    nxt_coef = torch.where(keep & m, g * F.pad(gz[:, 1:], (0, 1), value=1.0), 0.0)
    # 2. advantages: local part, response to the value entering, product to the chunk end
    a_adv = token_decay(gl, m, d, rp)
    delta = td_residual(rp, vp, nxt_local, g, m)
    aa = scan(torch.cat([delta, nxt_coef, _last(a_adv)]), a_adv.repeat(3, 1), method, chunk_size)
    adv, s, ga = aa[: 2 * n], aa[2 * n : 4 * n], aa[4 * n :]
    summary = torch.stack([z[:, 0], gz[:, 0], adv[:, 0], s[:, 0], ga[:, 0]], -1)
    fields = _parameter("gamma", gamma, r.device) | _parameter("gamma * lam", gamma_lam, r.device)
    c = _gather(summary, group, _describe("gae", summary, t_local, method, **fields))
    z_in = _solve(c[..., 0], c[..., 1])  # value entering each chunk
    head_adv = c[..., 2] + through(c[..., 3], z_in)
    a_in = _solve(head_adv, c[..., 4])  # advantage entering each chunk
    adv = adv + through(s, _own(z_in, group).unsqueeze(-1))
    adv = adv + through(ga, _own(a_in, group).unsqueeze(-1))
    adv = torch.where(m, adv, 0.0)
    ret = torch.where(m, vp + adv, 0.0)
    return _unpieces(adv, n), _unpieces(ret, n)


def _last(a: torch.Tensor) -> torch.Tensor:
    """x for :func:`scan` whose result is the product of ``a`` from t to the row's end."""
    x = torch.zeros_like(a)
    x[:, -1] = a[:, -1]
    return x


def cp_reinforce_returns(token_rewards, outcome, mask, gamma, group, method, kl_coef=None):
    """REINFORCE++ returns on zigzag shards: discounted returns over action tokens of
    ``token_rewards`` ``[N, 2L]``, plus ``outcome`` ``[N]`` on the row's globally last action
    token (found from the per-chunk summaries, no extra collective)."""
    group_rank_size(group, "cp_group")
    n, t_local = token_rewards.shape
    xp, m = _pieces(token_rewards), _pieces(mask)
    gp = gamma.reshape(n, 1).repeat(2, 1)
    a = token_decay(gp, m, None, xp)
    # one-hot on each chunk's last action token (if any)
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos, -1).amax(-1, keepdim=True)
    onehot = (pos == last).to(xp.dtype)
    yy = scan(torch.cat([torch.where(m, xp, 0.0), _last(a), onehot]), a.repeat(3, 1), method)
    y, g, u = yy[: 2 * n], yy[2 * n : 4 * n], yy[4 * n :]
    has = m.any(-1).to(xp.dtype)
    summary = torch.stack([y[:, 0], g[:, 0], u[:, 0], has], -1)
    fields = _parameter("gamma", gamma, xp.device) | _parameter("kl_coef", kl_coef, xp.device)
    call = _describe("reinforce_plus_plus_returns", summary, t_local, method, **fields)
    c = _gather(summary, group, call)
    # the globally last chunk holding an action token gets the outcome
    k = torch.arange(c.shape[1], device=c.device)
    k_last = torch.where(c[..., 3] > 0, k, -1).amax(-1, keepdim=True)  # [N, 1]
    hit = (k == k_last).to(xp.dtype) * outcome.reshape(n, 1).to(xp.dtype)  # [N, 2cp]
    y_in = _solve(c[..., 0] + hit * c[..., 2], c[..., 1])
    y = y + through(g, _own(y_in, group).unsqueeze(-1)) + u * _own(hit, group).unsqueeze(-1)
    return _unpieces(torch.where(m, y, 0.0), n)
