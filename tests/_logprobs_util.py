"""Shared helpers of the log-prob tests: run an op forward + backward, compare errors vs float64."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["assert_as_accurate", "forward_backward", "nan_filled_empty"]

EPS32 = torch.finfo(torch.float32).eps


def forward_backward(
    fn: Callable, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], **kw
) -> list[torch.Tensor | None]:
    """``[logp, entropy, *input grads]`` (detached) of ``fn(*inputs, **kw)`` under upstream
    ``grads`` (one per output; None skips that output). Float inputs are leaves needing grad."""
    leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    outs = fn(*leaves, **kw)
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads, strict=True)
             if o is not None and g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    res = [None if o is None else o.detach() for o in outs]
    return res + [x.grad for x in leaves if x.is_floating_point()]


def assert_as_accurate(
    fast: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, factor: float, what: str
) -> None:
    """``max|fast − exact| ≤ factor · max|ref − exact|`` (``exact``: float64).

    ``ref`` is the same-precision PyTorch reference on the same inputs; its measured error sets
    the tolerance. The bound is never below one float32 rounding of the largest exact value
    (a correctly rounded result may differ from ``exact`` by that much even where ``ref`` is
    lucky).
    """
    assert fast.shape == exact.shape, (what, fast.shape, exact.shape)
    if exact.numel() == 0:
        return
    exact = exact.double()
    err_fast = (fast.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    floor = EPS32 * exact.abs().max().item()
    bound = max(factor * err_ref, floor)
    assert err_fast <= bound, f"{what}: error {err_fast:.3g} > {factor} x reference {err_ref:.3g}"


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
