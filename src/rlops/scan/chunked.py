"""The discounted reverse scan vectorised over time in chunks (any device, autograd).

Inside a chunk, with ``Y`` the carry entering from the next chunk,
``y[t] = local[t] + (a[t] * ... * a[end]) * Y``, ``local`` the chunk's own scan; the carries
obey the same recurrence one level up and are solved by the same function on a sequence C
times shorter (depth log_C T). A constant decay scans a chunk as one matrix product, a
per-token one by log2(C) doubling steps; a zero decay is an exact cut (docs/design/scan.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops.scan.decay import decayed, is_per_token

__all__ = ["DEFAULT_CHUNK_ROWWISE", "DEFAULT_CHUNK_TOKENWISE", "scan_chunked"]

DEFAULT_CHUNK_ROWWISE = 64
DEFAULT_CHUNK_TOKENWISE = 16
_FULL = ("none", "ieee")  # fp32_precision values that keep float32 products in float32


def _reduced_fp32_matmul(device_type: str) -> bool:
    """Whether float32 matrix products on ``device_type`` may run in reduced precision (a read
    of the process's setting, never written)."""
    if device_type == "cuda":
        return torch.backends.cuda.matmul.fp32_precision not in _FULL
    if device_type == "cpu":
        # torch's stubs lack the mkldnn backend's ``matmul`` namespace, which exists at run time
        return torch.backends.mkldnn.matmul.fp32_precision not in _FULL  # type: ignore[attr-defined]
    return False


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in full precision: float32 operands go through float64 where the process lets
    float32 products run reduced, and while ``torch.compile`` traces."""
    if a.dtype == torch.float32 and (
        torch.compiler.is_compiling() or _reduced_fp32_matmul(a.device.type)
    ):  # while tracing, float64 whatever the setting: no backend flag is read into a graph
        return torch.matmul(a.double(), b.double()).to(a.dtype)
    return torch.matmul(a, b)


def _chunks(x: torch.Tensor, c: int, fill: float) -> torch.Tensor:
    """``[N, T]`` -> ``[N, ceil(T/c), c]``, padding the end of time with ``fill``."""
    n, t_len = x.shape
    pad = -t_len % c
    if pad:
        x = F.pad(x, (0, pad), value=fill)
    return x.reshape(n, -1, c)


def _shift_next(y: torch.Tensor) -> torch.Tensor:
    """``out[:, c] = y[:, c+1]``, 0 for the last position."""
    return F.pad(y[:, 1:], (0, 1))


def _scan_rowwise(x: torch.Tensor, w: torch.Tensor, c: int) -> torch.Tensor:
    """x ``[N, T]``, w ``[N, 1]`` or ``[1, 1]`` (float64): decay constant along time."""
    n, t_len = x.shape
    c = min(c, t_len)
    xc = _chunks(x, c, 0.0)  # [N, nC, C]
    j = torch.arange(c + 1, device=x.device, dtype=torch.float64)
    powers = w**j  # [N|1, C+1]: w^0 .. w^C, 0^0 = 1
    lag = j[:c, None] - j[None, :c]  # [k, t] -> k - t
    wt = torch.where(lag >= 0, powers[:, lag.clamp(min=0).long()], 0.0).to(x.dtype)
    if wt.shape[0] == 1:
        local = _matmul(xc.reshape(-1, c), wt[0]).view_as(xc)
    else:
        local = _matmul(xc, wt)
    if xc.shape[1] == 1:
        return local.view(n, -1)[:, :t_len]
    carries = _scan_rowwise(local[:, :, 0], powers[:, c:], c)  # y at each chunk's first step
    to_end = powers[:, 1:].flip(-1).to(x.dtype)  # [N|1, C]: w^(C-t)
    local = local + _shift_next(carries).unsqueeze(-1) * to_end.unsqueeze(1)
    return local.view(n, -1)[:, :t_len]


def _scan_tokenwise(x: torch.Tensor, a: torch.Tensor, c: int) -> torch.Tensor:
    """x ``[N, T]``, a ``[N, T]``: one decay per token."""
    n, t_len = x.shape
    c = min(c, t_len)
    y = _chunks(x, c, 0.0)  # becomes the chunk-local scan
    p = _chunks(a, c, 1.0)  # becomes prod a[t..end of chunk]
    d = 1
    while d < c:  # log2(C) doubling steps, each covering twice the span
        y = torch.cat([y[..., :-d] + decayed(p[..., :-d], y[..., d:]), y[..., -d:]], dim=-1)
        p = torch.cat([p[..., :-d] * p[..., d:], p[..., -d:]], dim=-1)
        d *= 2
    if y.shape[1] == 1:
        return y.view(n, -1)[:, :t_len]
    carries = _scan_tokenwise(y[:, :, 0], p[:, :, 0], c)
    y = y + decayed(p, _shift_next(carries).unsqueeze(-1).expand_as(p))
    return y.reshape(n, -1)[:, :t_len]


def _reach(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """What the non-finite entries of ``x`` put on each step of a row whose decay is constant and
    above 0: every earlier step is reached (``a^k·inf`` is inf for any ``a > 0``), so ``y[t]`` is
    NaN where a NaN, or both infinities, lie at ``k >= t``, else that infinity; 0 where none."""

    def at_or_after(flag: torch.Tensor) -> torch.Tensor:
        return flag.to(torch.uint8).flip(-1).cummax(-1).values.flip(-1).bool()

    nan = at_or_after(torch.isnan(x))
    pos, neg = at_or_after(x == torch.inf), at_or_after(x == -torch.inf)
    inf = torch.where(pos, torch.inf, torch.where(neg, -torch.inf, 0.0)).to(x.dtype)
    return torch.where(nan | (pos & neg), torch.nan, inf)


def _scan_rowwise_exact(x: torch.Tensor, w: torch.Tensor, c: int) -> torch.Tensor:
    """:func:`_scan_rowwise` where a non-finite ``x[k]`` reaches no later step: the chunk
    matrix has zeros above its diagonal, and ``0 · NaN`` is NaN, so the finite part is scanned
    with those entries at 0 and :func:`_reach` adds theirs (on CPU only when there are some: a
    host read of a CPU tensor, no device synchronisation; a finite sum says every entry is
    finite, and one that overflows only takes the longer way). Their gradient is then 0."""
    if x.device.type == "cpu" and bool(torch.isfinite(x.detach().sum())):
        return _scan_rowwise(x, w, c)
    bad = ~torch.isfinite(x)
    return _scan_rowwise(torch.where(bad, 0.0, x), w, c) + _reach(x, bad)


def scan_chunked(
    x: torch.Tensor, decay: float | torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]``; ``decay`` a float, ``[N, 1]`` or ``[N, T]``.

    ``x`` is in the compute dtype (float32 or float64; bfloat16, which the compiled kernels
    read as it is, is scanned in float32); the result has its dtype. Differentiable with
    respect to ``x`` (and a per-token ``decay``).
    """
    if x.dtype == torch.bfloat16:
        return scan_chunked(x.float(), decay, chunk_size).to(x.dtype)
    n, t_len = x.shape
    if n == 0 or t_len == 0:
        return x.clone()
    if is_per_token(decay, t_len):
        c = chunk_size or DEFAULT_CHUNK_TOKENWISE
        return _scan_tokenwise(x, decay.to(x.dtype), max(c, 2))
    c = chunk_size or DEFAULT_CHUNK_ROWWISE
    if not isinstance(decay, torch.Tensor):
        if float(decay) == 0.0:
            return x.clone()
        w = torch.full((1, 1), float(decay), dtype=torch.float64, device=x.device)  # no copy
        return _scan_rowwise_exact(x, w, max(c, 2))
    w = decay.reshape(-1, 1).to(torch.float64)
    return torch.where(w == 0, x, _scan_rowwise_exact(x, w, max(c, 2)))
