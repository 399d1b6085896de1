"""What ``mask``, ``dones`` and the bootstrap mean for the scan-based estimators, written once
as the scans' inputs and decays, and the one carrier of a GAE or returns call
(docs/design/masks.md)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rlops._checks import as_dtype, check_indicator, check_same_device, shape_error
from rlops._types import CPLayout, Group
from rlops.scan import Case, case_of, scan
from rlops.scan.decay import decayed


@dataclasses.dataclass(slots=True)
class GaeInputs:
    """One checked call of GAE or discounted returns, what every backend takes.

    ``rewards`` / ``values`` ``[N, T]`` in the compute dtype or both bfloat16 (:meth:`widened`;
    ``values`` None for returns, with
    ``gamma_lam = gamma``); ``mask`` / ``dones`` bool or None (``dones``: every sequence end,
    truncations included); ``gamma`` / ``gamma_lam`` floats, ``[N, 1]`` or ``[N]`` tensors
    (``[N]`` in the backends' form, :meth:`per_row`); ``cut`` ``[N, T]`` the value after each
    end (0 where terminated) or None; ``end`` ``[N]`` the value after the row's end or None.
    Made once per call and not changed after (not a frozen dataclass: its ``__init__`` costs
    6 us more when the caches are cold)."""

    rewards: torch.Tensor
    values: torch.Tensor | None
    mask: torch.Tensor | None
    dones: torch.Tensor | None
    gamma: float | torch.Tensor
    gamma_lam: float | torch.Tensor
    cut: torch.Tensor | None = None
    end: torch.Tensor | None = None
    chunk_size: int | None = None
    cp_group: Group = None
    cp_layout: CPLayout = "zigzag"

    @property
    def case(self) -> Case:
        """What the dispatch decides on (:class:`rlops.scan.Case`)."""
        inputs = (self.values, self.gamma, self.gamma_lam, self.cut, self.end)
        cp, discounts = self.cp_group is not None, (self.gamma, self.gamma_lam)
        return case_of(self.rewards, *inputs, cp=cp, discounts=discounts)

    def per_row(self, dtype: torch.dtype) -> GaeInputs:
        """This call with the discounts as ``[N]`` tensors of ``dtype``."""
        n, device = self.rewards.shape[0], self.rewards.device
        g, gl = as_rows(self.gamma, n, dtype, device), as_rows(self.gamma_lam, n, dtype, device)
        return dataclasses.replace(self, gamma=g, gamma_lam=gl)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, gamma_lam)`` of a call in the backends' form (tensors, :meth:`per_row`)."""
        g, gl = self.gamma, self.gamma_lam
        assert isinstance(g, torch.Tensor) and isinstance(gl, torch.Tensor), "per_row() first"
        return g, gl

    def widened(self) -> GaeInputs:
        """This call in the compute dtype: bfloat16 rewards and values (kept so for the compiled
        kernels, which read them as they are) in float32."""
        if self.rewards.dtype != torch.bfloat16:
            return self
        v = None if self.values is None else self.values.float()
        return dataclasses.replace(self, rewards=self.rewards.float(), values=v)

    def cast(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """A per-row discount in the compute dtype (a float stays a float)."""
        return value.to(self.rewards.dtype) if isinstance(value, torch.Tensor) else value

    def twice(self, gamma_lam: float | torch.Tensor) -> GaeInputs:
        """This call's rows stacked twice, ``[2N, T]``: the first N with this ``gamma_lam``, the
        next N with ``gamma_lam`` (a float or ``[N, 1]``) — two λ in one scan per step."""
        n, device = self.rewards.shape[0], self.rewards.device

        def two(x):
            return None if x is None else torch.cat([x, x])

        def col(d):  # float64: exactly the float a Python number is
            return as_rows(d, n, torch.float64, device).reshape(n, 1)

        g = two(col(self.gamma)) if isinstance(self.gamma, torch.Tensor) else self.gamma
        return dataclasses.replace(
            self,
            rewards=two(self.rewards),
            values=two(self.values),
            mask=two(self.mask),
            dones=two(self.dones),
            gamma=g,
            gamma_lam=torch.cat([col(self.gamma_lam), col(gamma_lam)]),
            cut=two(self.cut),
            end=two(self.end),
        )


def indicators(shape, ref: torch.Tensor, mask, dones):
    """Check the optional ``mask`` and ``dones`` of ``rewards`` ``ref``; return them as bool."""
    check_indicator("mask", mask, shape)
    check_indicator("dones", dones, shape)
    check_same_device("rewards", ref, mask=mask, dones=dones)
    mask = None if mask is None else as_dtype(mask, torch.bool)
    dones = None if dones is None else as_dtype(dones, torch.bool)
    return mask, dones


def bootstrap_inputs(bootstrap, truncated, ref: torch.Tensor, dones, dtype):
    """Check ``bootstrap`` and ``truncated`` of ``rewards`` ``ref`` ``[B, T]`` (``dones`` bool
    or None); return ``(ends, cut, end)``: every sequence end (``dones | truncated``, bool, or
    None), the cut value at each end (``bootstrap`` where truncated, 0 elsewhere, ``[B, T]`` in
    ``dtype``, or None) and the value entering at the row's end (``[B]`` in ``dtype``, or
    None)."""
    b, t = ref.shape
    if bootstrap is None:
        if truncated is not None:
            raise ValueError(
                "truncated needs bootstrap= (a [B, T] tensor: the value of the state after "
                "each truncated token)"
            )
        return dones, None, None
    if not isinstance(bootstrap, torch.Tensor):
        raise TypeError(f"bootstrap must be a torch.Tensor or None, got {type(bootstrap).__name__}")
    if not bootstrap.is_floating_point():
        raise TypeError(f"bootstrap must be a floating-point tensor, got {bootstrap.dtype}")
    check_same_device("rewards", ref, bootstrap=bootstrap)
    if tuple(bootstrap.shape) == (b,):
        if truncated is not None:
            raise ValueError(
                f"truncated needs a per-token bootstrap [B, T] = {[b, t]} (the value of the "
                f"state after each truncated token), got bootstrap of shape {[b]}"
            )
        return dones, None, bootstrap.to(dtype)
    if tuple(bootstrap.shape) == (b, t):
        if truncated is None:
            raise ValueError(
                "a per-token bootstrap [B, T] needs truncated= (a [B, T] bool: where a sequence "
                "is cut and bootstraps); for the row's end alone pass a [B] bootstrap"
            )
        check_indicator("truncated", truncated, (b, t))
        check_same_device("rewards", ref, truncated=truncated)
        tr = truncated.bool()
        ends = tr if dones is None else dones | tr
        return ends, torch.where(tr, bootstrap.to(dtype), 0.0), None
    raise shape_error(
        "bootstrap",
        f"[B] = {[b]} (the row's end) or [B, T] = {[b, t]} (with truncated=)",
        bootstrap.shape,
    )


def enter(x: torch.Tensor, a, carry: torch.Tensor) -> torch.Tensor:
    """``x`` of a scan with ``carry`` ``[N]`` entering from the right of the last token:
    ``x[T-1] + a[T-1]·carry`` (an exact cut where ``a[T-1] == 0``)."""
    if x.shape[-1] == 0:
        return x
    a_last = torch.as_tensor(a, dtype=x.dtype, device=x.device)
    a_last = a_last.expand_as(x)[:, -1] if a_last.dim() else a_last.expand(x.shape[0])
    last = x[:, -1] + decayed(a_last, carry.to(x.dtype))
    return torch.cat([x[:, :-1], last.unsqueeze(-1)], -1)


def shift_in(z: torch.Tensor, tail) -> torch.Tensor:
    """``z[t+1]`` at every t, with ``tail`` (a number, ``[N]`` or None for 0) past the end."""
    if z.shape[-1] == 0:
        return z
    if tail is None or not isinstance(tail, torch.Tensor):
        return F.pad(z[:, 1:], (0, 1), value=0.0 if tail is None else tail)
    return torch.cat([z[:, 1:], tail.to(z.dtype).reshape(-1, 1)], -1)


def returns_input(r, mask, ends, gamma, cut=None, end=None):
    """The input ``x`` of the discounted-returns scan: ``r`` on action tokens, 0 elsewhere, plus
    the bootstrap: ``γ·cut`` on an action token that ends a sequence, ``cut`` itself on a
    mask-0 end (it passes through mask-0 tokens, one ``γ`` at the last action token before
    it), and the row's ``end`` entering at the last token."""
    x = r if mask is None else torch.where(mask, r, 0.0)
    if cut is not None:
        g = torch.as_tensor(gamma, dtype=r.dtype, device=r.device).expand_as(r)
        boot = decayed(g, cut) if mask is None else torch.where(mask, decayed(g, cut), cut)
        x = torch.where(ends, x + boot, x)
    if end is not None:
        x = enter(x, token_decay(gamma, mask, ends, r), end)
    return x


def as_rows(value: float | torch.Tensor, b: int, dtype, device) -> torch.Tensor:
    """A discount given as a float or a ``[B, 1]`` tensor, as a ``[B]`` tensor."""
    if isinstance(value, torch.Tensor):
        return value.reshape(b).to(dtype)
    return torch.full((b,), value, dtype=dtype, device=device)


def token_decay(discount, mask, dones, like: torch.Tensor):
    """Per-token decay: ``discount`` on action tokens, 1 (pass through) on the others, 0 where
    a sequence ends. A float or ``[B, 1]`` unchanged when neither mask nor dones is given."""
    if mask is None and dones is None:
        return discount
    if isinstance(discount, torch.Tensor):
        a = discount.to(like.dtype).expand_as(like)
    else:  # a fill, not a host-to-device copy (which would synchronise the stream)
        a = torch.full_like(like, float(discount))
    if mask is not None:
        a = torch.where(mask, a, 1.0)
    if dones is not None:
        a = torch.where(dones, 0.0, a)
    return a


def pass_through_decay(mask: torch.Tensor, dones: torch.Tensor | None, dtype) -> torch.Tensor:
    """Decay of the next-action-value scan: 1 on mask-0 tokens (the value of a later action
    passes through), 0 on action tokens (they hold their own value) and at dones."""
    a = ~mask if dones is None else ~mask & ~dones
    return a.to(dtype)


def next_action_value(
    values, mask, dones, method: str, chunk_size=None, cut=None, end=None
) -> torch.Tensor:
    """``V`` at the next action token of the same sequence; past the last one the sequence's
    cut value (``cut`` at its end, ``end`` at the row's end; 0 where None)."""
    if mask is None:
        nxt = shift_in(values, end)
    else:
        # z[t] = V at the first action token at or after t (the cut value at a mask-0 end)
        a = pass_through_decay(mask, dones, values.dtype)
        x = torch.where(mask, values, 0.0 if cut is None else cut)
        z = scan(x if end is None else enter(x, a, end), a, method, chunk_size)
        nxt = shift_in(z, end)
    if dones is None:
        return nxt
    return torch.where(dones, 0.0 if cut is None else cut, nxt)


def td_residual(r, v, next_value, gamma, mask) -> torch.Tensor:
    """``δ = r + γ·V_next − V`` on action tokens, 0 on the others (their rewards are ignored);
    a zero ``γ`` cuts ``V_next`` exactly (selected away, so an inf bootstrap gives no NaN)."""
    g = gamma.to(r.dtype) if isinstance(gamma, torch.Tensor) else gamma  # a float stays one
    delta = r + decayed(g, next_value) - v
    return delta if mask is None else torch.where(mask, delta, 0.0)
