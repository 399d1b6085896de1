"""The advantage contract: :func:`check_advantages`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlops.advantages.masking import GaeInputs
from rlops.advantages.reference import gae_reference
from rlops.scan.reference import scan_reference
from rlops.testing._common import accepts, first, generator, measure, run_checks
from rlops.testing.report import Report

__all__ = ["ADVANTAGE_CHECKS", "check_advantages"]

ADVANTAGE_CHECKS = ("values", "masks", "dones", "long_rows", "edges")

_EXPLAIN = {
    "values": "the estimator's recurrence is wrong (an off-by-one bootstrap, V[T] not 0, "
    "gamma and lam swapped) or loses precision",
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


def _rows(value: float, n: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float64)


def _prefix_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None] < torch.tensor(lengths)[:, None]


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
    (a tuple's first element is taken: ``(advantages, returns)``). ``mask`` is a bool
    ``[B, T]`` action mask; a function that also takes ``dones=`` (bool ``[B, T]``, True at
    the last token of each sequence of a packed row) is checked for it too.

    The definition is :func:`rlops.advantages.reference.gae_reference`, the serial loop in
    float64: on action tokens ``δ_t = r_t + γ·V_next − V_t``, ``A_t = δ_t + γλ·A_next``,
    "next" the next *action* token (mask-0 tokens are skipped: the result equals the
    estimator on the compacted action-only sequence), 0 past the end. Only action tokens
    are compared (no loss reads the others). The rule: within ``2·e + 4 ulps``, ``e`` the
    error of the same serial loop in float32 on the same inputs.

    Checks (in this order, with these names):

    * ``values``: float32 rows of lengths 256, 200, 1, 131, ``gamma``, ``lam``.
    * ``masks``: rows with tool-output spans of mask 0 between turns; the figure names the
      semantics the function has: ``skip`` (the definition; passes), ``restart`` (each turn
      its own episode), ``zero`` (r, V zeroed and decayed through) or ``ignore``.
    * ``dones``: sequences packed in a row (only if ``fn`` takes ``dones=``; else skipped).
    * ``long_rows``: two float32 rows of ``long_length`` tokens (32768) with dense rewards.
    * ``edges``: γ, λ in {0, 1} (γ in {0, 1} for returns): finite and within the rule.

    Args:
        fn: the function under test.
        estimator: ``"gae"`` or ``"returns"`` (discounted reward-to-go).
        gamma, lam: the discount and GAE λ of every check but ``edges``.
        long_length: ``T`` of ``long_rows``.
        device: where the inputs are made; the definition runs on the CPU in float64.
        seed: the seed of the inputs.

    Returns:
        a :class:`rlops.testing.Report` with the five checks above.

    Example:
        >>> import rlops
        >>> from rlops.testing import check_advantages
        >>> def gae_fn(rewards, values, mask, gamma, lam, dones=None):
        ...     return rlops.gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones)[0]
        >>> check_advantages(gae_fn, long_length=4096).failed
        []
    """
    if estimator not in ("gae", "returns"):
        raise ValueError(f"estimator must be 'gae' or 'returns', got {estimator!r}")
    gae = estimator == "gae"
    dev = torch.device(device)

    def inputs(b: int, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed + s)
        return torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)

    def call(
        r: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        g: float,
        lm: float,
        dones: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {} if dones is None else {"dones": dones.to(dev)}
        r, v, mask = r.to(dev), v.to(dev), mask.to(dev)
        out = fn(r, v, mask, g, lm, **extra) if gae else fn(r, mask, g, **extra)
        out = first(out, "the advantages" if gae else "the returns")
        if out.shape != r.shape:
            raise ValueError(
                f"the function returned shape {tuple(out.shape)}, expected "
                f"{tuple(r.shape)} (the rewards')"
            )
        return out

    def definition(
        r: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        g: float,
        lm: float,
        dtype: torch.dtype,
        dones: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = r.shape[0]
        gamma_lam = g * lm if gae else g
        x = GaeInputs(
            r.to(dtype),
            v.to(dtype) if gae else None,
            mask,
            dones,
            _rows(g, n).to(dtype),
            _rows(gamma_lam, n).to(dtype),
        )
        return gae_reference(x)[0]

    def rule(r, v, mask, g, lm, dones=None):
        got = call(r, v, mask, g, lm, dones)
        ref = definition(r, v, mask, g, lm, torch.float64, dones)
        plain = definition(r, v, mask, g, lm, torch.float32, dones)
        return measure(got, ref, plain, where=mask), got

    def values():
        lengths = [256, 200, 1, 131]
        r, v = inputs(4, 256, 0)
        m, _ = rule(r, v, _prefix_mask(lengths, 256), gamma, lam)
        return m.ok, m.err, m.text()

    def masks():
        r, v = inputs(4, 160, 10)
        mask = torch.zeros(4, 160, dtype=torch.bool)
        for a, b in _TURNS:
            mask[:, a:b] = True
        mask[1, 128:] = False
        mask[2, 3:] = False
        m, got = rule(r, v, mask, gamma, lam)
        # the semantics peers have: each turn its own episode; mask-0 tokens as actions with
        # r = V = 0; the mask not read at all
        restart = mask & ~torch.cat([mask[:, 1:], torch.zeros(4, 1, dtype=torch.bool)], 1)
        alternatives = {
            "restart": definition(r, v, mask, gamma, lam, torch.float64, restart),
            "zero": definition(r * mask, v * mask, None, gamma, lam, torch.float64),
            "ignore": definition(r, v, None, gamma, lam, torch.float64),
        }
        o = got.detach().to("cpu", torch.float64)
        near = {k: float((o - a)[mask].abs().max()) for k, a in alternatives.items()}
        if m.ok:
            return True, m.err, f"semantics: skip (mask-0 tokens skipped); {m.text()}"
        close = [k for k, d in near.items() if d <= max(m.bound, 1e-6)]
        said = close[0] if close else "none of skip, restart, zero, ignore"
        return False, m.err, f"semantics: {said}; {m.text()}"

    def dones():
        if not accepts(fn, "dones"):
            return None, None, "skipped: the function takes no dones="
        r, v = inputs(4, 96, 20)
        mask = _prefix_mask([96, 90, 50, 7], 96)
        mask[0, 30:35] = False
        d = torch.zeros(4, 96, dtype=torch.bool)
        d[0, [20, 47, 95]] = True
        d[1, [0, 1, 60]] = True
        d[2, 33] = True
        d[3, 6] = True
        m, _ = rule(r, v, mask, gamma, lam, d)
        return m.ok, m.err, m.text()

    def long_rows():
        t = long_length
        r, v = inputs(2, t, 30)
        mask = _prefix_mask([t, max(t - 1000, 1)], t)
        got = call(r, v, mask, gamma, lam)
        # on prefix-masked rows the definition is the serial scan of the TD errors (each
        # computed as the serial loop computes it): one multiply-add per step, quick at 32K
        found = []
        for dt in (torch.float64, torch.float32):
            rd, vd = r.to(dt), v.to(dt)
            if gae:
                v_next = torch.cat([vd[:, 1:], vd.new_zeros(2, 1)], 1)
                v_next = torch.where(torch.cat([mask[:, 1:], mask[:, :1] & False], 1), v_next, 0.0)
                x = rd + gamma * v_next - vd
            else:
                x = rd
            decay = torch.full((2, 1), gamma * lam if gae else gamma, dtype=dt)
            found.append(scan_reference(torch.where(mask, x, 0.0), decay))
        m = measure(got, found[0], found[1], where=mask)
        return m.ok, m.err, f"T={long_length}: {m.text()}"

    def edges():
        r, v = inputs(4, 64, 40)
        mask = _prefix_mask([64, 50, 1, 33], 64)
        cases = [(g, lm) for g in (0.0, 1.0) for lm in ((0.0, 1.0) if gae else (lam,))]
        parts, ok, worst = [], True, 0.0
        for g, lm in cases:
            m, _ = rule(r, v, mask, g, lm)
            ok, worst = ok and m.ok, max(worst, m.err / max(m.bound, 1e-300))
            where = f"gamma={g:g}" + (f", lam={lm:g}" if gae else "")
            if not m.ok:
                parts.append(f"{where}: max error {m.err:.2e} > bound {m.bound:.2e}")
        figure = "; ".join(parts) if parts else "gamma, lam in {0, 1}: all within the rule"
        return ok, worst, f"{figure} (largest error/bound {worst:.2f})"

    bodies = {
        "values": values,
        "masks": masks,
        "dones": dones,
        "long_rows": long_rows,
        "edges": edges,
    }
    shown = [f"estimator={estimator!r}"]
    return run_checks("check_advantages", fn, shown, ADVANTAGE_CHECKS, _EXPLAIN, bodies)
