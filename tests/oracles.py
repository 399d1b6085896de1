"""Independent float64 oracles for the discounted reverse scan and the estimators built on it.

Written from the definitions, for clarity rather than speed, and sharing no code with rlops:

* ``discounted_cumsum_oracle``: the serial loop ``y[t] = x[t] + a[t] * y[t + 1]``, ``y = 0`` past
  the end, along any dimension, with a scalar or broadcastable discount.
* ``gae_oracle`` and ``discounted_returns_oracle`` handle ``mask`` and ``dones`` the *other* way
  from a scan with pass-through tokens: each row is split into sequences at its dones, each
  sequence is compacted to its action tokens (mask 1), the plain estimator runs on that short
  list with Python floats, and the results are scattered back (zero on every other token).
* ``gae_bootstrap_oracle`` and ``discounted_returns_bootstrap_oracle``: the same with truncated
  sequences (``bootstrap``, ``truncated``): each piece between ends keeps the value of the state
  after it (0 where it terminated) as the value after its last action token.
* ``reversed_cumsum_oracle``: the discount-1 case in closed form (a reversed cumulative sum),
  vectorised, for very long rows where a Python loop would be slow.

Every oracle takes tensors of any floating dtype, reads their values exactly and returns a
float64 CPU tensor. With ``extended=True`` it computes in ``numpy.longdouble`` instead (80-bit
with a 64-bit significand on x86-64) and returns that numpy array: a float64 oracle computes
exactly what a float64 serial loop computes, so it cannot measure a float64 output's own
rounding error; the extended one can (see ``EXTENDED``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "EXTENDED",
    "bootstrap_pieces",
    "compact_sequences",
    "discounted_cumsum_oracle",
    "discounted_returns_bootstrap_oracle",
    "discounted_returns_oracle",
    "gae_bootstrap_oracle",
    "gae_oracle",
    "reversed_cumsum_oracle",
    "sequence_spans",
]


# Whether numpy's longdouble is wider than float64 here (not on Windows or Apple silicon).
EXTENDED = np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant


def _arr(t: torch.Tensor | np.ndarray | float, dt: type) -> np.ndarray:
    """Exact values of ``t`` as a numpy array of ``dt`` (every torch float fits in float64)."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().to(torch.float64).numpy().astype(dt)
    return np.asarray(t, dtype=np.float64).astype(dt)


def _dtype(extended: bool) -> type:
    return np.longdouble if extended else np.float64


def _result(y: np.ndarray, extended: bool) -> torch.Tensor | np.ndarray:
    return y if extended else torch.from_numpy(np.ascontiguousarray(y))


def _per_row(value: float | torch.Tensor, rows: int, dt: type) -> list:
    """A float or a ``[B]`` tensor as one numpy scalar of ``dt`` per row."""
    v = _arr(value, dt).reshape(-1)
    if v.size == 1:
        return [v[0]] * rows
    assert v.size == rows, f"per-row value has {v.size} entries for {rows} rows"
    return list(v)


def discounted_cumsum_oracle(
    x: torch.Tensor, discount: float | torch.Tensor, dim: int = -1, *, extended: bool = False
) -> torch.Tensor | np.ndarray:
    """``y[t] = x[t] + discount[t] * y[t + 1]`` along ``dim``, ``y = 0`` past the end."""
    dt = _dtype(extended)
    xs = _arr(x, dt)
    a = np.broadcast_to(_arr(discount, dt), xs.shape)
    xs = np.moveaxis(xs, dim, -1)
    a = np.moveaxis(a, dim, -1)
    y = np.zeros_like(xs)
    carry = np.zeros(xs.shape[:-1], dtype=dt)
    for t in reversed(range(xs.shape[-1])):
        carry = xs[..., t] + a[..., t] * carry
        y[..., t] = carry
    return _result(np.moveaxis(y, -1, dim), extended)


def reversed_cumsum_oracle(
    x: torch.Tensor, dim: int = -1, *, extended: bool = False
) -> torch.Tensor | np.ndarray:
    """The discount-1 scan in closed form, vectorised: ``y[t] = sum_{k >= t} x[k]``."""
    xs = np.flip(_arr(x, _dtype(extended)), axis=dim)
    return _result(np.flip(np.cumsum(xs, axis=dim), axis=dim), extended)


def sequence_spans(dones_row: Sequence[bool]) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` spans of one row: a done at ``t`` closes a sequence at ``t``."""
    spans, start = [], 0
    for t, done in enumerate(dones_row):
        if done:
            spans.append((start, t + 1))
            start = t + 1
    if start < len(dones_row):
        spans.append((start, len(dones_row)))
    return spans


def compact_sequences(
    mask: torch.Tensor | None, dones: torch.Tensor | None, shape: tuple[int, int]
) -> list[list[list[int]]]:
    """For each row, its sequences as lists of action-token indices (empty lists dropped)."""
    rows, length = shape
    m = np.ones(shape, dtype=bool) if mask is None else _arr(mask, np.float64) != 0
    d = np.zeros(shape, dtype=bool) if dones is None else _arr(dones, np.float64) != 0
    out = []
    for b in range(rows):
        seqs = []
        for start, end in sequence_spans(list(d[b]) if length else []):
            steps = [t for t in range(start, end) if m[b, t]]
            if steps:
                seqs.append(steps)
        out.append(seqs)
    return out


def _plain_gae(rs: list, vs: list, gamma, lam) -> list:
    """GAE on one sequence with no mask and no done inside: V = 0 and A = 0 past its end."""
    adv = [0.0] * len(rs)
    next_value, next_adv = 0.0, 0.0  # promoted to the dtype of the numpy scalars
    for i in reversed(range(len(rs))):
        delta = rs[i] + gamma * next_value - vs[i]
        next_adv = delta + gamma * lam * next_adv
        next_value = vs[i]
        adv[i] = next_adv
    return adv


def _plain_returns(rs: list, gamma) -> list:
    out = [0.0] * len(rs)
    acc = 0.0
    for i in reversed(range(len(rs))):
        acc = rs[i] + gamma * acc
        out[i] = acc
    return out


def gae_oracle(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    *,
    extended: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)``, ``[B, T]``, by compacting each sequence."""
    dt = _dtype(extended)
    r, v = _arr(rewards, dt), _arr(values, dt)
    rows = r.shape[0]
    gammas, lams = _per_row(gamma, rows, dt), _per_row(lam, rows, dt)
    adv, ret = np.zeros_like(r), np.zeros_like(r)
    for b, seqs in enumerate(compact_sequences(mask, dones, r.shape)):
        for steps in seqs:
            a = _plain_gae([r[b, t] for t in steps], [v[b, t] for t in steps], gammas[b], lams[b])
            for t, at in zip(steps, a, strict=True):
                adv[b, t] = at
                ret[b, t] = at + v[b, t]
    return _result(adv, extended), _result(ret, extended)


def discounted_returns_oracle(
    rewards: torch.Tensor,
    gamma: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    *,
    extended: bool = False,
) -> torch.Tensor | np.ndarray:
    """Discounted reward-to-go, ``[B, T]``, by compacting each sequence."""
    dt = _dtype(extended)
    r = _arr(rewards, dt)
    gammas = _per_row(gamma, r.shape[0], dt)
    out = np.zeros_like(r)
    for b, seqs in enumerate(compact_sequences(mask, dones, r.shape)):
        for steps in seqs:
            g = _plain_returns([r[b, t] for t in steps], gammas[b])
            for t, gt in zip(steps, g, strict=True):
                out[b, t] = gt
    return _result(out, extended)


# --------------------------------------------------------------------------- bootstrap
# Truncated sequences, written as their definition: each row is split at its ends (a done or a
# truncation); a piece that ends in a truncation at token d continues into a state of value
# bootstrap[b, d], the row's last piece into one of value bootstrap[b] when bootstrap is one
# value per row; every other piece terminated (value 0 after it). Each piece is compacted to its
# action tokens and the plain estimator runs on it with that value after its last action.


def bootstrap_pieces(
    mask: torch.Tensor | None,
    dones: torch.Tensor | None,
    truncated: torch.Tensor | None,
    bootstrap: torch.Tensor | None,
    shape: tuple[int, int],
    dt: type = np.float64,
) -> list[list[tuple[list[int], object]]]:
    """For each row, its sequences as ``(action-token indices, value after the sequence)``."""
    rows, length = shape
    m = np.ones(shape, dtype=bool) if mask is None else _arr(mask, np.float64) != 0
    d = np.zeros(shape, dtype=bool) if dones is None else _arr(dones, np.float64) != 0
    tr = np.zeros(shape, dtype=bool) if truncated is None else _arr(truncated, np.float64) != 0
    boot = None if bootstrap is None else _arr(bootstrap, dt)
    out = []
    for b in range(rows):
        pieces, start = [], 0
        for t in range(length):
            if d[b, t] or tr[b, t]:
                after = boot[b, t] if tr[b, t] else dt(0.0)
                pieces.append(([s for s in range(start, t + 1) if m[b, s]], after))
                start = t + 1
        if start < length:  # the row's last piece, cut by the row's end
            after = boot[b] if boot is not None and boot.ndim == 1 else dt(0.0)
            pieces.append(([s for s in range(start, length) if m[b, s]], after))
        out.append([(steps, after) for steps, after in pieces if steps])
    return out


def gae_bootstrap_oracle(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    *,
    extended: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` ``[B, T]`` with truncated sequences bootstrapping: on each
    compacted sequence ``delta[i] = r[i] + gamma * V[i + 1] - V[i]`` with ``V`` after the last
    action the value after the sequence, ``A[i] = delta[i] + gamma * lam * A[i + 1]``,
    ``A = 0`` after the last action."""
    dt = _dtype(extended)
    r, v = _arr(rewards, dt), _arr(values, dt)
    rows = r.shape[0]
    gammas, lams = _per_row(gamma, rows, dt), _per_row(lam, rows, dt)
    adv, ret = np.zeros_like(r), np.zeros_like(r)
    for b, pieces in enumerate(bootstrap_pieces(mask, dones, truncated, bootstrap, r.shape, dt)):
        for steps, after in pieces:
            next_value, next_adv = after, dt(0.0)
            for t in reversed(steps):
                delta = r[b, t] + gammas[b] * next_value - v[b, t]
                next_adv = delta + gammas[b] * lams[b] * next_adv
                next_value = v[b, t]
                adv[b, t] = next_adv
                ret[b, t] = next_adv + v[b, t]
    return _result(adv, extended), _result(ret, extended)


def discounted_returns_bootstrap_oracle(
    rewards: torch.Tensor,
    gamma: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    *,
    extended: bool = False,
) -> torch.Tensor | np.ndarray:
    """Reward-to-go ``[B, T]`` with truncated sequences bootstrapping: on each compacted
    sequence ``G[i] = r[i] + gamma * G[i + 1]``, ``G`` after the last action the value after
    the sequence."""
    dt = _dtype(extended)
    r = _arr(rewards, dt)
    gammas = _per_row(gamma, r.shape[0], dt)
    out = np.zeros_like(r)
    for b, pieces in enumerate(bootstrap_pieces(mask, dones, truncated, bootstrap, r.shape, dt)):
        for steps, after in pieces:
            acc = after
            for t in reversed(steps):
                acc = r[b, t] + gammas[b] * acc
                out[b, t] = acc
    return _result(out, extended)
