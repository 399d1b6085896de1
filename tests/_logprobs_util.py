"""Shared helpers of the log-prob tests: run an op forward + backward, compare errors with
float64 (or, for float64 results, a ``numpy.longdouble`` oracle)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from tests.tolerances import assert_error_within

__all__ = [
    "assert_as_accurate",
    "assert_as_accurate_as_float64",
    "forward_backward",
    "longdouble_oracle",
    "nan_filled_empty",
    "sum_pi_squared_oracle",
]


def forward_backward(
    fn: Callable, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], **kw
) -> list[torch.Tensor | None]:
    """``[logp, entropy, *input grads]`` (detached) of ``fn(*inputs, **kw)`` under upstream
    ``grads`` (one per output; None skips that output). Float inputs are leaves needing grad."""
    leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    outs = fn(*leaves, **kw)
    pairs = [
        (o, g.to(o.dtype))
        for o, g in zip(outs, grads, strict=True)
        if o is not None and g is not None and o.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    res = [None if o is None else o.detach() for o in outs]
    return res + [x.grad for x in leaves if x.is_floating_point()]


def assert_as_accurate(
    fast: torch.Tensor,
    ref: torch.Tensor,
    exact: torch.Tensor,
    factor: float,
    what: str,
    magnitude: float | None = None,
) -> None:
    """The suite's rule (``tests.tolerances``) for a log-prob result against float64:
    ``max|fast − exact| ≤ factor · max|ref − exact|`` plus a floor of a few ulps, in ``fast``'s
    dtype, of the largest ``|exact|`` (or of ``magnitude``).

    ``ref`` is the same-precision PyTorch reference on the same inputs; its measured error sets
    the tolerance.
    """
    assert fast.shape == exact.shape, (what, fast.shape, exact.shape)
    if exact.numel() == 0:
        return
    exact = exact.double()
    err_fast = (fast.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    scale = exact.abs().max().item() if magnitude is None else magnitude
    assert_error_within(what, err_fast, err_ref, fast.dtype, scale, factor)


@contextlib.contextmanager
def nan_filled_empty() -> Iterator[None]:
    """Within the block, ``torch.empty`` returns NaN-filled floating tensors, so that an
    output element that the code forgets to write shows up as NaN instead of stale memory."""
    original = torch.empty

    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = original


def longdouble_oracle(
    logits: torch.Tensor,
    target: torch.Tensor,
    support: torch.Tensor,
    grads: Sequence[torch.Tensor],
    *,
    temperature: float = 1.0,
    over_support: bool = False,
) -> list[np.ndarray]:
    """``[logp, entropy, grad]`` from the definitions in ``numpy.longdouble`` (80-bit where the
    platform has it), for float64 inputs ``logits`` ``[N, V]``, ``target`` ``[N]``.

    ``z = logits / τ``; ``K = support ∪ {target}``; ``logp = z_y − lse(z over K)``; the entropy
    ``H = −Σ p log p`` over all of ``z`` (over ``K`` with ``over_support``); the gradient
    w.r.t. the logits ``(g_logp·(onehot − p_K) − g_ent·p·(log p + H)) / τ`` under the upstream
    gradients ``grads`` (``[N]`` each).
    """
    ld = np.longdouble
    z = logits.double().numpy().astype(ld) / ld(temperature)
    rows, y = np.arange(z.shape[0]), target.numpy()
    keep = support.numpy().copy()
    keep[rows, y] = True
    zk = np.where(keep, z, ld(-np.inf))

    def softmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = x - x.max(axis=1, keepdims=True)
        log_s = np.log(np.exp(d).sum(axis=1, keepdims=True))
        return np.exp(d - log_s), d - log_s

    with np.errstate(invalid="ignore"):  # 0 · log 0 outside the support: taken as 0
        p_k, log_pk = softmax(zk)
        p, log_p = softmax(zk if over_support else z)
        ent = -np.where(p > 0, p * log_p, ld(0)).sum(axis=1)
        dh = np.where(p > 0, p * (log_p + ent[:, None]), ld(0))
    onehot = np.zeros_like(z)
    onehot[rows, y] = 1
    g_logp, g_ent = (g.double().numpy().astype(ld)[:, None] for g in grads)
    grad = (g_logp * (onehot - p_k) - g_ent * dh) / ld(temperature)
    return [log_pk[rows, y], ent, grad]


def assert_as_accurate_as_float64(
    fast: torch.Tensor, ref: torch.Tensor, oracle: np.ndarray, factor: float, what: str
) -> None:
    """:func:`assert_as_accurate` for float64 results against a ``longdouble`` ``oracle``
    (``ref`` the float64 reference): the same rule, the floor in float64 ulps."""
    assert tuple(fast.shape) == oracle.shape, (what, fast.shape, oracle.shape)
    if oracle.size == 0:
        return
    ld = np.longdouble
    err_fast = float(np.abs(fast.numpy().astype(ld) - oracle).max())
    err_ref = float(np.abs(ref.numpy().astype(ld) - oracle).max())
    assert_error_within(what, err_fast, err_ref, fast.dtype, float(np.abs(oracle).max()), factor)


def sum_pi_squared_oracle(
    logits: torch.Tensor, target: torch.Tensor, support: torch.Tensor | None, temperature: float
) -> np.ndarray:
    """``Σ_v p_v²`` from its definition in ``numpy.longdouble``, ``p`` the softmax of
    ``z = logits / τ`` over ``K = support ∪ {target}`` (all of ``z`` when ``support`` is None);
    ``logits`` ``[N, V]`` float64, ``target`` ``[N]``."""
    ld = np.longdouble
    z = logits.double().numpy().astype(ld) / ld(temperature)
    if support is not None:
        keep = support.numpy().copy()
        keep[np.arange(z.shape[0]), target.numpy()] = True
        z = np.where(keep, z, ld(-np.inf))
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return (p * p).sum(axis=1)
