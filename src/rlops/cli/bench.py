"""``rlops bench``: time rlops against the implementations it replaces, on the user's shapes.

Section "advantages": GAE for every method side by side in one run, with ratios and the
memory floor (one fused add plus one copy over the same bytes: reading rewards and values,
writing two [B, T] outputs, as GAE must).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import rlops
from rlops.cli import baselines
from rlops.cli.measure import PeakMemory, sync, time_median

__all__ = ["Row", "bench_advantages"]

SLOW_LIMIT_S = 10.0


@dataclasses.dataclass
class Row:
    section: str
    shape: str
    method: str
    seconds: float
    extrapolated: bool = False
    peak_bytes: int | None = None


def _time_or_extrapolate(make, fn, t_len: int, device, repeats: int) -> tuple[float, bool]:
    """Time a baseline linear in T; extrapolate from a shorter T when it would take too long."""
    probe = min(t_len, 2048)
    args = make(probe)
    t_probe = time_median(lambda: fn(*args), device, repeats=1, warmup=0)
    estimate = t_probe * t_len / probe
    if probe == t_len:
        return time_median(lambda: fn(*args), device, repeats=repeats), False
    if estimate > SLOW_LIMIT_S:
        return estimate, True
    args = make(t_len)
    return time_median(lambda: fn(*args), device, repeats=max(1, min(repeats, 3))), False


def bench_advantages(
    batch: int,
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    gamma: float = 1.0,
    lam: float = 0.95,
    repeats: int = 10,
    progress=None,
) -> list[Row]:
    """Time GAE at ``[batch, T]`` for each T: per-token loop, chunk loop, rlops, the floor."""
    device = torch.device(device)
    rows: list[Row] = []
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(t_len: int):
        r = torch.randn(batch, t_len, generator=gen, dtype=dtype).to(device)
        v = torch.randn(batch, t_len, generator=gen, dtype=dtype).to(device)
        return r, v

    rlops.gae(*make(64), gamma=gamma, lam=lam)  # compile / warm every path once
    for t_len in seq_lens:
        shape = f"{batch}x{t_len}"
        r, v = make(t_len)
        seconds, extra = _time_or_extrapolate(
            make, lambda a, b: baselines.gae_token_loop(a, b, gamma, lam), t_len, device, repeats
        )
        rows.append(Row("advantages", shape, "per-token loop", seconds, extra))
        seconds, extra = _time_or_extrapolate(
            make, lambda a, b: baselines.gae_chunk_loop(a, b, gamma, lam), t_len, device, repeats
        )
        rows.append(Row("advantages", shape, "chunk loop (C=256)", seconds, extra))
        for method in ("chunked", "auto"):
            fn = lambda m=method, r=r, v=v: rlops.gae(r, v, gamma=gamma, lam=lam, method=m)  # noqa: E731
            seconds = time_median(fn, device, repeats=repeats)
            with PeakMemory(device) as peak:
                out = fn()
                sync(device)
            del out
            label = "rlops chunked" if method == "chunked" else "rlops auto"
            rows.append(Row("advantages", shape, label, seconds, False, peak.bytes))
        seconds = time_median(
            lambda r=r, v=v: (torch.add(r, v), r.clone()), device, repeats=repeats
        )
        rows.append(Row("advantages", shape, "memory floor", seconds))
        if progress is not None:
            progress()
    return rows


def tensor_bytes(batch: int, t_len: int, dtype: torch.dtype) -> int:
    return batch * t_len * torch.empty(0, dtype=dtype).element_size()


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf
