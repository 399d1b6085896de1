"""Compiled single-pass CPU kernels (numba, an optional extra: ``pip install rlops[fast]``).

One pass over the data: the time loop runs backwards over four rows at once, so four
independent multiply-add chains are in flight instead of one latency-bound chain.
The kernels release the GIL and are single-threaded (numba's own thread pool fights torch's
OpenMP threads for the cores); large inputs are split by rows over a few Python threads.

GAE and discounted returns are fused into one kernel: mask skipping, episode ends and the
next-action value are handled in the same pass, so nothing but the outputs is written.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["available", "gae_compiled", "require", "scan_compiled"]

_LANES = 4
_MIN_ELEMENTS_PER_THREAD = 1 << 17


@functools.cache
def _numba():
    try:
        import numba
    except ImportError:
        return None
    return numba


def available() -> bool:
    """Whether numba can be imported (the ``fast`` extra)."""
    return _numba() is not None


def require(x: torch.Tensor) -> None:
    if not available():
        raise ValueError(
            'method="compiled" needs numba: pip install "rlops[fast]" (or use method="chunked")'
        )
    if x.device.type != "cpu":
        raise ValueError(f'method="compiled" runs on CPU tensors, got device {x.device}')


def _kernels():
    """The numba kernels module (compiled on first use of each kernel, then cached on disk)."""
    from rlops.scan import _numba_kernels

    return _numba_kernels


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="rlops-scan")


def _run(kernel, n_rows: int, n_elements: int, *args) -> None:
    """Run ``kernel(*args, rows)`` over groups of 4 rows, on several threads when it pays."""
    groups = [
        tuple(min(r + k, n_rows - 1) for k in range(_LANES)) for r in range(0, n_rows, _LANES)
    ]
    threads = min(torch.get_num_threads(), n_elements // _MIN_ELEMENTS_PER_THREAD, len(groups))
    if threads <= 1:
        for rows in groups:
            kernel(*args, rows)
        return
    per = -(-len(groups) // threads)
    parts = [groups[i : i + per] for i in range(0, len(groups), per)]

    def work(part):
        for rows in part:
            kernel(*args, rows)

    list(_pool(threads).map(work, parts))


def _array(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> np.ndarray:
    """``t`` as a contiguous ``[N, T]`` array; a missing input is an unread ``[N, 1]`` stand-in."""
    if t is None:
        return np.zeros((n, 1), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    return t.to(dtype).contiguous().numpy()


def scan_compiled(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]`` (float32/64, CPU); ``decay`` a float, [N, 1] or [N, T]."""
    x = x.contiguous()
    n, t_len = x.shape
    y = torch.empty_like(x)
    if n == 0 or t_len == 0:
        return y
    k = _kernels()
    if isinstance(decay, torch.Tensor) and decay.shape[-1] == t_len and t_len > 1:
        a = decay.to(x.dtype).expand(n, t_len).contiguous()
        _run(k.scan_tokens, n, x.numel(), x.numpy(), a.numpy(), y.numpy())
    else:
        if isinstance(decay, torch.Tensor):
            w = decay.to(x.dtype).reshape(-1).expand(n).contiguous()
        else:
            w = torch.full((n,), float(decay), dtype=x.dtype)
        _run(k.scan_rows, n, x.numel(), x.numpy(), w.numpy(), y.numpy())
    return y


def gae_compiled(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    dones: torch.Tensor | None,
    gamma: torch.Tensor,
    gamma_lam: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused GAE in one pass; with ``values=None``, discounted returns (pass ``gamma_lam=gamma``).

    ``rewards``/``values`` ``[N, T]`` in the compute dtype (float32/64, CPU); ``mask``/``dones``
    ``[N, T]`` 0/1 or None; ``gamma``/``gamma_lam`` ``[N]``. Returns ``(advantages, returns)``;
    without values both are the same tensor.
    """
    rewards = rewards.contiguous()
    n, t_len = rewards.shape
    ret = torch.empty_like(rewards)
    adv = ret if values is None else torch.empty_like(rewards)
    if n == 0 or t_len == 0:
        return adv, ret
    kernel = _kernels().GAE[(values is not None, mask is not None, dones is not None)]
    _run(
        kernel,
        n,
        rewards.numel(),
        rewards.numpy(),
        _array(values, n, rewards.dtype),
        _array(mask, n, torch.bool),
        _array(dones, n, torch.bool),
        gamma.to(rewards.dtype).expand(n).contiguous().numpy(),
        gamma_lam.to(rewards.dtype).expand(n).contiguous().numpy(),
        adv.numpy(),
        ret.numpy(),
    )
    return adv, ret
