"""The advantage contract: :func:`check_advantages`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlops._checks import as_int, check_choice, check_unit_interval
from rlops.advantages.reference import gae_reference
from rlops.advantages.returns import GaeInputs
from rlops.scan.reference import scan_reference
from rlops.testing import _common as common
from rlops.testing.report import Report

__all__ = ["ADVANTAGE_CHECKS", "check_advantages"]

ADVANTAGE_CHECKS = ("values", "masks", "dones", "long_rows", "edges")

_EXPLAIN = {
    "values": "the estimator's recurrence is wrong (an off-by-one bootstrap, V[T] not 0, "
    "gamma and lam swapped), loses precision, or returns another shape than [B, T]",
    "masks": "mask-0 tokens inside a row (tool output, observations) are not skipped: the "
    "estimator restarts, zeroes or ignores them, so multi-turn advantages are wrong",
    "dones": "sequence ends inside a packed row leak value or advantage across sequences",
    "long_rows": "long rows lose precision (half-precision accumulation, scaling by "
    "(gamma*lam)^-t) or overflow",
    "edges": "gamma or lam of 0 or 1 gives NaN or a wrong result (log 0 in a log-space scan, "
    "0 * inf)",
}

#: the multi-turn row of ``masks``: (start, end) spans of action tokens, the rest mask 0
_TURNS = ((0, 20), (40, 80), (100, 128))
#: the arguments of each estimator, in the documented positional order
_ARGS = {
    "gae": ("rewards", "values", "mask", "gamma", "lam"),
    "returns": ("rewards", "mask", "gamma"),
}


def _rows(value: float, n: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float64)


def _prefix_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None] < torch.tensor(lengths)[:, None]


def _positional(fn: Callable, estimator: str) -> int:
    """How many of the estimator's arguments ``fn`` takes by position, the rest by keyword
    under their names: all of them where it can (``fn(rewards, values, mask, gamma, lam)``),
    else the fewest keywords (``rlops.gae(rewards, values, *, gamma, lam, mask)``). A
    signature that fits no such split is a ``TypeError`` naming the expected one."""
    names = _ARGS[estimator]
    sig = common.signature(fn)
    if sig is None:
        return len(names)
    for k in range(len(names), -1, -1):
        if common.binds(sig, *names[:k], **{n: n for n in names[k:]}):
            return k
    expected = ", ".join(names)
    raise TypeError(
        f"check_advantages(estimator={estimator!r}): {common.fn_name(fn)}{sig} takes no "
        f"({expected}): expected fn({expected}[, dones=]), each argument by position or by "
        "keyword under that name"
    )


@dataclass(frozen=True)
class _Setup:
    """One run of the contract: the function, how it takes its arguments, the options."""

    fn: Callable
    gae: bool
    positional: int
    gamma: float
    lam: float
    long_length: int
    device: torch.device
    seed: int
    names: tuple[str, ...] = field(default=())

    def inputs(self, b: int, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = common.generator(self.seed + s)
        return torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)

    def raw(self, r, v, mask, g, lm, dones=None) -> object:
        dev = self.device
        args = (
            (r.to(dev), v.to(dev), mask.to(dev), g, lm)
            if self.gae
            else (r.to(dev), mask.to(dev), g)
        )
        k = self.positional
        kwargs = dict(zip(self.names[k:], args[k:], strict=True))
        if dones is not None:
            kwargs["dones"] = dones.to(dev)
        return self.fn(*args[:k], **kwargs)

    def call(self, r, v, mask, g, lm, dones=None) -> torch.Tensor:
        """``fn``'s advantages (or returns), which must have the rewards' shape ``[B, T]``."""
        out = common.first(
            self.raw(r, v, mask, g, lm, dones), "the advantages" if self.gae else "the returns"
        )
        if out.shape != r.shape:
            raise ValueError(
                f"the function returned shape {list(out.shape)}, the definition's is "
                f"{list(r.shape)} (the rewards')"
            )
        return out

    def definition(self, r, v, mask, g, lm, dtype, dones=None, magnitude=False) -> torch.Tensor:
        """The serial loop in ``dtype``; with ``magnitude``, the running sums of the terms'
        magnitudes, ``Σ_k (γλ)^k (|r| + |V| + γ·max|V|)`` over the same action tokens."""
        n = r.shape[0]
        gamma_lam = g * lm if self.gae else g
        rewards, values = r.to(dtype), v.to(dtype) if self.gae else None
        if magnitude:
            rewards = rewards.abs()
            if values is not None:
                rewards = rewards + values.abs() + g * values.abs().amax(-1, keepdim=True)
            values = None
        x = GaeInputs(
            rewards, values, mask, dones, _rows(g, n).to(dtype), _rows(gamma_lam, n).to(dtype)
        )
        return gae_reference(x)[0]

    def rule(self, r, v, mask, g, lm, dones=None) -> tuple[common.Measured, torch.Tensor]:
        got = self.call(r, v, mask, g, lm, dones)
        ref = self.definition(r, v, mask, g, lm, torch.float64, dones)
        plain = self.definition(r, v, mask, g, lm, torch.float32, dones)
        size = self.definition(r, v, mask, g, lm, torch.float64, dones, magnitude=True)
        return common.measure(got, ref, plain, where=mask, scale=size), got


# --------------------------------------------------------------------------- the checks
def _values(s: _Setup):
    lengths = [256, 200, 1, 131]
    r, v = s.inputs(4, 256, 0)
    m, _ = s.rule(r, v, _prefix_mask(lengths, 256), s.gamma, s.lam)
    return m.ok, m.err, m.text()


def _masks(s: _Setup):
    r, v = s.inputs(4, 160, 10)
    mask = torch.zeros(4, 160, dtype=torch.bool)
    for a, b in _TURNS:
        mask[:, a:b] = True
    mask[1, 128:] = False
    mask[2, 3:] = False
    m, got = s.rule(r, v, mask, s.gamma, s.lam)
    if m.ok:
        return True, m.err, f"semantics: skip (mask-0 tokens skipped); {m.text()}"
    # the semantics peers have: each turn its own episode; mask-0 tokens as actions with
    # r = V = 0; the mask not read at all
    restart = mask & ~torch.cat([mask[:, 1:], torch.zeros(4, 1, dtype=torch.bool)], 1)
    ones = torch.ones_like(mask)
    alternatives = {
        "restart": s.definition(r, v, mask, s.gamma, s.lam, torch.float64, restart),
        "zero": s.definition(r * mask, v * mask, ones, s.gamma, s.lam, torch.float64),
        "ignore": s.definition(r, v, ones, s.gamma, s.lam, torch.float64),
    }
    o = got.detach().to("cpu", torch.float64)
    near = {k: float((o - a)[mask].abs().max()) for k, a in alternatives.items()}
    close = [k for k, d in near.items() if d <= max(m.bound, 1e-6)]
    said = close[0] if close else "none of skip, restart, zero, ignore"
    return False, m.err, f"semantics: {said}; {m.text()}"


def _dones(s: _Setup):
    if not common.accepts(s.fn, "dones"):
        return None, None, "skipped: the function takes no dones="
    r, v = s.inputs(4, 96, 20)
    mask = _prefix_mask([96, 90, 50, 7], 96)
    mask[0, 30:35] = False
    d = torch.zeros(4, 96, dtype=torch.bool)
    d[0, [20, 47, 95]] = True
    d[1, [0, 1, 60]] = True
    d[2, 33] = True
    d[3, 6] = True
    m, _ = s.rule(r, v, mask, s.gamma, s.lam, d)
    return m.ok, m.err, m.text()


def _long_rows(s: _Setup):
    t = s.long_length
    r, v = s.inputs(2, t, 30)
    mask = _prefix_mask([t, max(t - 1000, 1)], t)
    got = s.call(r, v, mask, s.gamma, s.lam)
    # on prefix-masked rows the definition is the serial scan of the TD errors (each
    # computed as the serial loop computes it): one multiply-add per step, quick at 32K
    decay = s.gamma * s.lam if s.gae else s.gamma
    found = []
    for dt in (torch.float64, torch.float32):
        rd, vd = r.to(dt), v.to(dt)
        x = rd
        if s.gae:
            after = torch.cat([mask[:, 1:], mask[:, :1] & False], 1)
            v_next = torch.where(after, torch.cat([vd[:, 1:], vd.new_zeros(2, 1)], 1), 0.0)
            x = rd + s.gamma * v_next - vd
        found.append(scan_reference(torch.where(mask, x, 0.0), torch.full((2, 1), decay, dtype=dt)))
    terms = r.double().abs() + (v.double().abs() * (1 + s.gamma) if s.gae else 0.0)
    size = scan_reference(torch.where(mask, terms, 0.0), torch.full((2, 1), decay).double())
    m = common.measure(got, found[0], found[1], where=mask, scale=size)
    return m.ok, m.err, f"T={t}: {m.text()}"


def _edges(s: _Setup):
    r, v = s.inputs(4, 64, 40)
    mask = _prefix_mask([64, 50, 1, 33], 64)
    cases = [(g, lm) for g in (0.0, 1.0) for lm in ((0.0, 1.0) if s.gae else (s.lam,))]
    parts, ok, worst = [], True, 0.0
    for g, lm in cases:
        m, _ = s.rule(r, v, mask, g, lm)
        ok, worst = ok and m.ok, max(worst, m.err / max(m.bound, 1e-300))
        where = f"gamma={g:g}" + (f", lam={lm:g}" if s.gae else "")
        if not m.ok:
            parts.append(f"{where}: max error {m.err:.2e} > bound {m.bound:.2e}")
    figure = "; ".join(parts) if parts else "gamma, lam in {0, 1}: all within the rule"
    return ok, worst, f"{figure} (largest error/bound {worst:.2f})"


_BODIES = {
    "values": _values,
    "masks": _masks,
    "dones": _dones,
    "long_rows": _long_rows,
    "edges": _edges,
}


def check_advantages(
    fn: Callable,
    *,
    estimator: str = "gae",
    gamma: float = 0.99,
    lam: float = 0.95,
    long_length: int = 32768,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Report:
    """Check an advantage (or return) estimator against its serial definition.

    ``estimator="gae"``: ``fn(rewards [B, T], values [B, T], mask [B, T], gamma, lam) ->
    advantages [B, T]``; ``estimator="returns"``: ``fn(rewards, mask, gamma) -> returns``
    (a tuple's first element is taken: ``(advantages, returns)``). Each argument goes by
    position where ``fn`` takes it so, else by keyword under that name (``rlops.gae`` and
    ``rlops.discounted_returns`` take ``gamma``, ``lam`` and ``mask`` by keyword and are
    checked as they are). ``mask`` is a bool ``[B, T]`` action mask; a function that also
    takes ``dones=`` (bool ``[B, T]``, True at the last token of each sequence of a packed
    row) is checked for it too. The result must have shape ``[B, T]``.

    The definition is :func:`rlops.advantages.reference.gae_reference`, the serial loop in
    float64: on action tokens ``δ_t = r_t + γ·V_next − V_t``, ``A_t = δ_t + γλ·A_next``,
    "next" the next *action* token (mask-0 tokens are skipped: the result equals the
    estimator on the compacted action-only sequence), 0 past the end. Only action tokens
    are compared. The rule: within ``2·e + 4·eps·M``, ``e`` the error of the same serial loop
    in float32 on the same inputs, ``M`` the running sum ``Σ_k (γλ)^k`` of the magnitudes of
    the terms (``|r| + |V| + γ·max|V|``, ``|r|`` for returns) at each token.

    Checks (in this order, with these names):

    * ``values``: float32 rows of lengths 256, 200, 1, 131, ``gamma``, ``lam``.
    * ``masks``: rows with tool-output spans of mask 0 between turns; the figure names the
      semantics the function has: ``skip`` (the definition; passes), ``restart`` (each turn
      its own episode), ``zero`` (r, V zeroed and decayed through) or ``ignore``.
    * ``dones``: sequences packed in a row (only if ``fn`` takes ``dones=``; else skipped).
    * ``long_rows``: two float32 rows of ``long_length`` tokens with dense rewards.
    * ``edges``: γ, λ in {0, 1} (γ in {0, 1} for returns): finite and within the rule.

    Args:
        fn: the function under test.
        estimator: ``"gae"`` or ``"returns"`` (discounted reward-to-go).
        gamma, lam: the discount and GAE λ (in [0, 1]) of every check but ``edges``.
        long_length: ``T`` (>= 1) of ``long_rows``.
        device: where the inputs are made; the definition runs on the CPU in float64.
        seed: the seed (an int >= 0) of the inputs.

    Returns:
        a :class:`rlops.testing.Report` with the five checks above.

    Raises:
        ValueError, TypeError: an option out of its range (naming it); ``fn``'s signature
            takes no such arguments; ``fn`` returns something other than a tensor or a tuple
            starting with one.

    Example:
        >>> import rlops
        >>> from rlops.testing import check_advantages
        >>> check_advantages(rlops.gae, long_length=4096).failed
        []
    """
    check_choice("estimator", estimator, tuple(_ARGS))
    g = float(check_unit_interval("gamma", gamma))
    lm = float(check_unit_interval("lam", lam))
    t = as_int("long_length", long_length, 1, tensor=False)
    dev, s0 = common.check_device(device), common.check_seed(seed)
    k = _positional(fn, estimator)
    s = _Setup(fn, estimator == "gae", k, g, lm, t, dev, s0, _ARGS[estimator])
    r, v = s.inputs(2, 4, 0)
    common.preflight(
        lambda: s.raw(r, v, torch.ones(2, 4, dtype=torch.bool), g, lm), "the advantages"
    )
    shown = [f"estimator={estimator!r}"]
    bodies = {name: (lambda body=body: body(s)) for name, body in _BODIES.items()}
    return common.run_checks("check_advantages", fn, shown, _EXPLAIN, bodies)
