"""The log-prob contract: :func:`check_logprobs`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlops._checks import as_int, check_bool, check_finite_positive
from rlops.logprobs.reference import logprobs_and_entropy_reference
from rlops.testing import _common as common
from rlops.testing.report import Report

__all__ = ["LOGPROB_CHECKS", "check_logprobs"]

LOGPROB_CHECKS = (
    "values",
    "vocab_tail",
    "gradients",
    "temperature",
    "batch_invariance",
    "masked_vocab",
    "large_logits",
    "low_precision",
)

_EXPLAIN = {
    "values": "the log-prob or entropy maths is wrong or loses precision (e.g. computed in "
    "half precision), or the result has another shape than [N]: the ratio against the "
    "sampler's log-probs is biased",
    "vocab_tail": "the last vocabulary entries are dropped or misread (an out-of-bounds or "
    "missing tail tile): tokens with high ids get wrong log-probs",
    "gradients": "the gradient does not reach the logits (a detached or None result, a fused "
    "backward that drifted from the forward): the policy does not learn what the loss says",
    "temperature": "the sampling temperature is applied zero times or twice: training "
    "log-probs differ from the sampler's, so every ratio is off",
    "batch_invariance": "a row's result depends on the other rows, the batch size or the "
    "padding (a batch-wide max, a reduction order that follows N): log-probs change with "
    "the micro-batch size",
    "masked_vocab": "-inf logits (masked vocabulary, top-k/top-p replay) give NaN or inf, "
    "usually p*log p evaluated as 0*(-inf)",
    "large_logits": "large logits overflow (exp without subtracting the max, or a cancelling "
    "entropy formula)",
    "low_precision": "bfloat16 logits lose more than rounding: accumulated in bfloat16, or "
    "divided by the temperature in bfloat16 (every logit rounded again)",
}

#: the logits' dtypes a contract can make
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: names under which a third positional parameter is taken to be the temperature
_TEMPERATURE_NAMES = ("temperature", "tau", "temp")
_FORMS = (
    "fn(logits [N, V], target [N], temperature) or fn(logits, target, *, temperature=) "
    "(a temperature parameter), or fn(logits, target) (checked at temperature 1)"
)

Pair = tuple[torch.Tensor, torch.Tensor | None]


def _temperature_form(fn: Callable) -> str:
    """How ``fn`` takes the temperature: ``"keyword"`` (a parameter named ``temperature``, or
    only ``**kwargs`` to take it), ``"positional"`` (a third positional parameter that is
    required or named like a temperature, or ``*args``), ``"none"`` (``fn(logits, target)``).
    A signature that fits none of them is a ``TypeError`` naming the forms."""
    sig = common.signature(fn)
    if sig is None:  # no signature to read (a builtin): the documented positional form
        return "positional"
    params = sig.parameters
    p = params.get("temperature")
    if p is not None and p.kind is not p.POSITIONAL_ONLY:
        return "keyword"
    positional = [
        q for q in params.values() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)
    ]
    if common.binds(sig, 0, 0, 1.0):
        third = positional[2] if len(positional) > 2 else None
        if third is None or third.default is third.empty or third.name in _TEMPERATURE_NAMES:
            return "positional"  # *args, a required third parameter, or one named tau/temp
    if common.binds(sig, 0, 0, temperature=1.0):
        return "keyword"
    if common.binds(sig, 0, 0):
        return "none"
    raise TypeError(f"check_logprobs: {common.fn_name(fn)}{sig} fits none of the forms {_FORMS}")


def _check_options(
    temperature: object,
    vocab_sizes: object,
    dtypes: object,
    rows: object,
    bitwise: object,
    device: object,
    seed: object,
) -> tuple[float, tuple[int, ...], tuple[torch.dtype, ...], int, torch.device, int]:
    """The contract's options, checked: a ``ValueError`` / ``TypeError`` naming the option."""
    tau = check_finite_positive("temperature", temperature)
    if isinstance(vocab_sizes, (str, bytes)) or not isinstance(vocab_sizes, Sequence):
        raise TypeError(
            f"vocab_sizes must be a sequence of ints (e.g. (1000, 50257)), got "
            f"{type(vocab_sizes).__name__}"
        )
    if not vocab_sizes:
        raise ValueError("vocab_sizes must name at least one vocabulary size, got ()")
    sizes = tuple(
        as_int(f"vocab_sizes[{i}]", v, 2, tensor=False) for i, v in enumerate(vocab_sizes)
    )
    if isinstance(dtypes, torch.dtype) or not isinstance(dtypes, Sequence) or not dtypes:
        raise TypeError(f"dtypes must be a non-empty sequence of torch dtypes, got {dtypes!r}")
    for dt in dtypes:
        if dt not in _DTYPES:
            raise ValueError(f"dtypes must be among {[str(d) for d in _DTYPES]}, got {dt!r}")
    n = as_int("rows", rows, 1, tensor=False)
    check_bool("bitwise", bitwise)
    return tau, sizes, tuple(dtypes), n, common.check_device(device), common.check_seed(seed)


def _definition(
    logits: torch.Tensor, target: torch.Tensor, tau: float, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference log-prob and entropy of ``logits``' values computed in ``dtype``, on the
    CPU (differentiable)."""
    out = logprobs_and_entropy_reference(logits.to("cpu", dtype), target.to("cpu"), temperature=tau)
    logp, ent = out[0], out[1]
    assert ent is not None
    return logp, ent


def _plain_dtype(logits: torch.Tensor) -> torch.dtype:
    """The plain computation's dtype: the logits', float32 for half logits (as torch's own
    ``log_softmax`` accumulates)."""
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _forms(
    logits: torch.Tensor, target: torch.Tensor, tau: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The two common correct forms of ``(logp, entropy)`` in the plain dtype (float32 for half
    logits), differentiable in ``logits``: the reference's, ``−Σ p·log p`` (in float64, the
    definition's own dtype, on the vocabulary rotated by one column: the same sums in another
    order, so that its difference from the definition measures float64's rounding), and the
    log-normaliser form, ``lse(z) − Σ p·z`` (a difference of terms of size ``|z|``)."""
    dt = _plain_dtype(logits)
    x = logits.to("cpu", dt)
    v = logits.shape[-1]
    rolled = dt == torch.float64
    a = _definition(x.roll(1, -1) if rolled else x, (target + rolled) % v, tau, dt)
    z = x / tau
    lse = torch.logsumexp(z, -1)
    b_logp = z.gather(-1, target.to("cpu").long()[:, None])[:, 0] - lse
    b_ent = lse - (torch.softmax(z, -1) * z.masked_fill(~torch.isfinite(z), 0.0)).sum(-1)
    return a, (b_logp, b_ent)


def _further(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise, whichever of ``a`` and ``b`` is further from ``ref``."""
    a, b = a.detach(), b.detach()
    return torch.where((a.double() - ref).abs() >= (b.double() - ref).abs(), a, b)


def _plain(
    logits: torch.Tensor, target: torch.Tensor, tau: float, ref: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain computation: of the two common correct forms (:func:`_forms`), elementwise
    the one further from the definition ``ref``, so that the rule allows the rounding either
    form makes."""
    a, b = _forms(logits.detach(), target, tau)
    return _further(a[0], b[0], ref[0]), _further(a[1], b[1], ref[1])


def _magnitude(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``[N]``: the magnitude of the terms a row's log-prob and entropy combine: the largest
    finite ``|z|/τ`` plus the log-normaliser ``|lse(z/τ)|``, which bounds every
    ``|log p_v| = |z_v/τ − lse|`` the entropy sums (and the log-prob is one of)."""
    z = logits.detach().to("cpu", torch.float64) / tau
    largest = torch.where(torch.isfinite(z), z.abs(), 0.0).amax(-1)
    return largest + torch.logsumexp(z, -1).abs()


@dataclass(frozen=True)
class _Setup:
    """One run of the contract: the function, how it takes the temperature, the options."""

    fn: Callable
    form: str
    temperature: float
    vocab_sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    rows: int
    bitwise: bool
    device: torch.device
    seed: int

    def raw(self, logits: torch.Tensor, target: torch.Tensor, tau: float) -> object:
        """``fn``'s result as it returns it, on this run's device."""
        logits, target = logits.to(self.device), target.to(self.device)
        if self.form == "keyword":
            return self.fn(logits, target, temperature=tau)
        if self.form == "positional":
            return self.fn(logits, target, tau)
        return self.fn(logits, target)

    def call(self, logits: torch.Tensor, target: torch.Tensor, tau: float | None = None) -> Pair:
        """``fn``'s ``(logp [N], entropy [N] | None)``; any other shape is a ``ValueError``
        naming both (nothing is reshaped or broadcast)."""
        out = self.raw(logits, target, self.temperature if tau is None else tau)
        logp, ent = (
            (out[0], out[1] if len(out) > 1 else None)
            if isinstance(out, (tuple, list)) and out
            else (out, None)
        )
        n = target.shape[0]
        for name, t in (("logp", logp), ("entropy", ent)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"the function's {name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != (n,):
                raise ValueError(
                    f"the function's {name} has shape {list(t.shape)}, the definition's is [{n}]"
                )
        assert isinstance(logp, torch.Tensor)
        return logp, ent

    def compare(self, logits: torch.Tensor, target: torch.Tensor, out: Pair, tau: float):
        """The rule on the log-prob and, where ``fn`` returns one, the entropy."""
        ref = _definition(logits, target, tau)
        plain = _plain(logits, target, tau, ref)
        scale = _magnitude(logits, tau)
        found = [("logp", _measure(out[0], ref[0], plain[0], scale))]
        if out[1] is not None:
            found.append(("entropy", _measure(out[1], ref[1], plain[1], scale)))
        return found

    def against_definition(
        self, logits: torch.Tensor, target: torch.Tensor, tau: float | None = None
    ) -> list[tuple[str, common.Measured]]:
        tau = self.temperature if tau is None else tau
        return self.compare(logits, target, self.call(logits, target, tau), tau)


def _measure(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, scale: torch.Tensor):
    """The rule, the plain computation rounded to the dtype the function returns."""
    if out.is_floating_point():
        plain = plain.to(out.dtype)
    return common.measure(out, ref, plain, scale=scale)


def _worst(found: list[tuple[str, common.Measured]]) -> tuple[bool, float, str]:
    ok = all(m.ok for _, m in found)
    name, m = max(found, key=lambda f: (not f[1].ok, f[1].err / max(f[1].bound, 1e-300)))
    return ok, m.err, f"{name} {m.text()}"


def _inputs(n: int, v: int, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = common.generator(seed)
    logits = torch.randn(n, v, generator=g) * scale
    target = torch.randint(0, v, (n,), generator=g)
    return logits, target


# --------------------------------------------------------------------------- the checks
def _values(s: _Setup):
    found = []
    for i, v in enumerate(s.vocab_sizes):
        for dt in s.dtypes:
            logits, target = _inputs(s.rows, v, s.seed + i)
            for name, m in s.against_definition(logits.to(dt), target):
                found.append((f"V={v} {str(dt).removeprefix('torch.')} {name}", m))
    return _worst(found)


def _vocab_tail(s: _Setup):
    found = []
    sizes = sorted({5, 257, 1031} | {v for v in s.vocab_sizes if v % 2})
    for i, v in enumerate(sizes):
        logits, _ = _inputs(s.rows, v, s.seed + 10 + i, scale=2.0)
        k = min(3, v)
        logits[:, v - 1] += 6.0  # the largest logit of every row is the very last entry
        target = v - 1 - torch.arange(s.rows) % k
        for name, m in s.against_definition(logits.to(s.dtypes[0]), target):
            found.append((f"V={v} {name}", m))
    return _worst(found)


def _gradients(s: _Setup):
    tau, dt0 = s.temperature, s.dtypes[0]
    logits, target = _inputs(s.rows, s.vocab_sizes[0], s.seed + 20)
    logits = logits.to(dt0)
    up = torch.randn(2, s.rows, generator=common.generator(s.seed + 21))
    z = logits.to(s.device).requires_grad_(True)
    logp, ent = s.call(z, target, tau)
    with_ent = ent is not None and ent.requires_grad
    if not logp.requires_grad and not with_ent:
        return False, None, "no gradient: the result does not require grad"

    def grad_of(z, logp, ent):
        loss = (logp * up[0].to(logp)).sum()
        if with_ent:
            loss = loss + (ent * up[1].to(ent)).sum()
        return torch.autograd.grad(loss, z, allow_unused=True)[0]

    got = grad_of(z, logp, ent)
    if got is None:
        return False, None, "no gradient reaches the logits (None)"
    zr = logits.to(torch.float64).requires_grad_(True)
    ref = grad_of(zr, *_definition(zr, target, tau))
    zp = logits.to(_plain_dtype(logits)).requires_grad_(True)
    form_a, form_b = _forms(zp, target, tau)  # the plain gradient: of either form (see _plain)
    plain = _further(grad_of(zp, *form_a), grad_of(zp, *form_b), ref)
    # each element of the gradient is made of its row's probabilities, each rounded at the
    # row's magnitude: the floor is ulps of that magnitude times the row's largest element
    scale = _magnitude(logits, tau)[:, None] * ref.detach().abs().amax(-1, keepdim=True)
    m = common.measure(got, ref, plain.to(got.dtype), scale=scale)
    what = "d(logp, entropy)/dlogits" if with_ent else "dlogp/dlogits"
    return m.ok, m.err, f"{what} {m.text()}"


def _temperature(s: _Setup):
    if s.form == "none":
        return None, None, "skipped: the function takes no temperature (checked at tau = 1)"
    taus = sorted({0.5, 2.0, s.temperature} - {1.0})
    logits, target = _inputs(s.rows, s.vocab_sizes[0], s.seed + 30)
    logits = logits.to(s.dtypes[0])
    parts, ok, worst = [], True, 0.0
    for tau in taus:
        out = s.call(logits, target, tau)
        found = s.compare(logits, target, out, tau)
        fit = max(m.err / max(m.bound, 1e-300) for _, m in found)
        worst = max(worst, fit)
        if fit <= 1.0:
            parts.append(f"tau={tau:g}: applied once")
            continue
        ok, said = False, "matches no power of tau"
        for k, what in ((0, "not applied"), (2, "applied twice")):
            other = _definition(logits, target, tau**k)
            bounds = [m.bound for _, m in found]
            errs = [
                float((o.detach().cpu().double() - r).abs().max())
                for o, r in zip(out, other, strict=False)
                if o is not None
            ]
            if all(e <= b for e, b in zip(errs, bounds, strict=False)):
                said = what
        parts.append(f"tau={tau:g}: {said} (error {fit:.1f} x bound at tau)")
    return ok, worst, "; ".join(parts) + f" (largest error/bound {worst:.2f})"


def _batch_invariance(s: _Setup):
    v0, dt0 = s.vocab_sizes[0], s.dtypes[0]
    logits, target = _inputs(16, v0, s.seed + 40)
    logits = logits.to(dt0)
    base = s.call(logits, target)
    bound = max(m.bound for _, m in s.compare(logits, target, base, s.temperature))
    g = common.generator(s.seed + 41)
    extra, extra_t = _inputs(51, v0, s.seed + 42)
    pad = torch.cat(
        [torch.zeros(8, v0), torch.full((8, v0), 100.0) + torch.randn(8, v0, generator=g)]
    ).to(dt0)
    pad_t = torch.zeros(16, dtype=target.dtype)
    # (label, logits, target, positions of base rows idx in the batch, idx)
    every = torch.arange(16)
    cases: list[tuple[str, torch.Tensor, torch.Tensor, Any, Any]] = [
        (f"row {i} alone", logits[i : i + 1], target[i : i + 1], [0], [i]) for i in (0, 7, 15)
    ]
    cases += [
        ("first 5 rows", logits[:5], target[:5], list(range(5)), list(range(5))),
        ("reversed", logits.flip(0), target.flip(0), every, every.flip(0)),
        (
            "N=67",
            torch.cat([extra[:20].to(dt0), logits, extra[20:].to(dt0)]),
            torch.cat([extra_t[:20], target, extra_t[20:]]),
            every + 20,
            every,
        ),
        ("padding rows", torch.cat([logits, pad]), torch.cat([target, pad_t]), every, every),
    ]
    worst, where = 0.0, cases[0][0]
    for label, z, t, pos, idx in cases:
        out = s.call(z, t)
        for a, b in zip(out, base, strict=True):
            if a is None or b is None:
                continue
            d = (a.detach().cpu().double()[pos] - b.detach().cpu().double()[idx]).abs()
            diff = float(torch.where(torch.isnan(d), math.inf, d).max())
            if diff > worst:
                worst, where = diff, label
    same = worst == 0.0
    ok = same if s.bitwise else worst <= bound
    rule = "bitwise demanded" if s.bitwise else f"bound {bound:.2e}"
    said = "bitwise identical" if same else f"worst: {where}"
    return (
        ok,
        worst,
        f"largest difference {worst:.2e} ({said}; {rule}) over N in "
        "{1, 5, 16, 32, 67}, reversed, padding rows",
    )


def _masked_vocab(s: _Setup):
    tau, rows, v0 = s.temperature, s.rows, s.vocab_sizes[0]
    logits, target = _inputs(rows, v0, s.seed + 50)
    g = common.generator(s.seed + 51)
    masked = torch.rand(rows, v0, generator=g) < 0.25
    masked[0] = True
    masked[0, torch.randperm(v0, generator=g)[:2]] = False
    masked[torch.arange(rows), target] = False
    logits = logits.masked_fill(masked, -math.inf).to(s.dtypes[0])
    z = logits.to(s.device).requires_grad_(True)
    out = s.call(z, target, tau)
    refs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    plains: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for i in range(rows):  # the definition on each row's finite entries
        kept = ~masked[i]
        zi = logits[i, kept][None]
        ti = kept[: target[i]].sum()[None]
        ref = _definition(zi, ti, tau)
        for dst, (lp, en) in ((refs, ref), (plains, _plain(zi, ti, tau, ref))):
            dst[0].append(lp)
            dst[1].append(en)
    scale = _magnitude(logits, tau)
    found = [("logp", _measure(out[0], torch.cat(refs[0]), torch.cat(plains[0]), scale))]
    if out[1] is not None:
        found.append(("entropy", _measure(out[1], torch.cat(refs[1]), torch.cat(plains[1]), scale)))
    ok, value, figure = _worst(found)
    live = [o for o in out if o is not None and o.requires_grad]
    if live:
        total = torch.zeros((), dtype=torch.float64, device=z.device)
        for o in live:
            total = total + o.sum()
        (grad,) = torch.autograd.grad(total, z, allow_unused=True)
        finite = grad is not None and bool(torch.isfinite(grad).all())
        ok = ok and finite
        figure += "; gradient finite" if finite else "; gradient not finite"
    return ok, value, figure


def _large_logits(s: _Setup):
    logits, target = _inputs(s.rows, s.vocab_sizes[0], s.seed + 60, scale=2500.0)
    logits = logits.clamp(-1e4, 1e4)
    for row, fill, at_target in ((0, 1e4, None), (1, -1e4, 1e4), (2, -1e4, None)):
        if row < s.rows:
            logits[row] = fill
            if at_target is not None:
                logits[row, target[row]] = at_target
    if s.rows > 3:
        logits[3, :] = 1e4
        logits[3, target[3]] = -1e4
    return _worst(s.against_definition(logits.to(s.dtypes[0]), target))


def _low_precision(s: _Setup):
    found = []
    for i, v in enumerate(s.vocab_sizes):
        logits, target = _inputs(s.rows, v, s.seed + 70 + i)
        for name, m in s.against_definition(logits.to(torch.bfloat16), target):
            found.append((f"V={v} {name}", m))
    return _worst(found)


_BODIES = {
    "values": _values,
    "vocab_tail": _vocab_tail,
    "gradients": _gradients,
    "temperature": _temperature,
    "batch_invariance": _batch_invariance,
    "masked_vocab": _masked_vocab,
    "large_logits": _large_logits,
    "low_precision": _low_precision,
}


def check_logprobs(
    fn: Callable,
    *,
    temperature: float = 1.0,
    vocab_sizes: Sequence[int] = (1000, 50257),
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    rows: int = 32,
    bitwise: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Report:
    """Check a log-prob (and entropy) function against the definition.

    ``fn(logits [N, V], target [N], temperature) -> logp [N]`` or ``(logp [N], entropy [N] |
    None)``, where ``logp = log_softmax(logits / τ)[target]`` and ``entropy = −Σ_v p_v·log p_v``,
    ``p = softmax(logits / τ)``. The temperature is passed as ``fn`` takes it: by keyword to a
    parameter named ``temperature`` (or to ``**kwargs``), positionally to a third parameter;
    ``fn(logits, target)`` is checked at τ = 1 (its ``temperature`` check is skipped). The
    outputs must have shape ``[N]``: nothing is reshaped or broadcast.

    The definition is :func:`rlops.logprobs.reference.logprobs_and_entropy_reference` in
    float64. The rule for an output in dtype ``d``: every element within
    ``2·e + 4·eps(d)·M`` of the definition, ``e`` the largest error of the plain computation
    (the reference in the logits' dtype, float32 for half logits, rounded to ``d``; in float64,
    the reference on the vocabulary in another order) on the same inputs and ``M`` the row's
    largest ``|z|/τ`` plus ``|log Σ exp(z/τ)|`` (which bounds every ``|log p_v|``: the
    magnitude of the terms a log-prob and an entropy combine).

    Checks (in this order, with these names):

    * ``values``: random logits ``[rows, V]`` for each of ``vocab_sizes`` and ``dtypes``.
    * ``vocab_tail``: odd vocabularies (5, 257, 1031 and the odd ones of ``vocab_sizes``) with
      the row's largest logits and the targets among the last entries.
    * ``gradients``: the gradient of ``Σ g·logp + Σ h·entropy`` (random ``g``, ``h``)
      reaches the logits and equals the definition's, within the rule.
    * ``temperature``: at τ = 0.5 and 2 (and ``temperature``) the result is the definition's
      at τ, not at 1 or τ² (applied once).
    * ``batch_invariance``: each row's result is the same alone, in the first rows, in a
      reversed batch, in a larger batch and beside padding rows: the largest difference is
      within the rule, or exactly 0 with ``bitwise=True``.
    * ``masked_vocab``: a quarter of each row's logits (never the target) at −inf, one row
      with only two finite entries: finite results (and gradients) within the rule.
    * ``large_logits``: logits of magnitude up to 1e4: finite and within the rule.
    * ``low_precision``: bfloat16 logits for each of ``vocab_sizes``, within the rule.

    Args:
        fn: the function under test.
        temperature: τ > 0 of every check but ``temperature``.
        vocab_sizes: the vocabularies (ints >= 2) of ``values`` and ``low_precision`` (the
            first also of the other checks).
        dtypes: the logits' dtypes (float16, bfloat16, float32, float64) of ``values`` (the
            first also of the other checks).
        rows: ``N`` (>= 1) of each check's batch.
        bitwise: whether ``batch_invariance`` demands identical bits.
        device: where the inputs are made (the function's device); the definitions run on
            the CPU in float64.
        seed: the seed (an int >= 0) of every input.

    Returns:
        a :class:`rlops.testing.Report` with the eight checks above.

    Raises:
        ValueError, TypeError: an option out of its range (naming it); ``fn``'s signature
            fits no form above; ``fn`` returns something other than a tensor or a tuple
            starting with one.

    Example:
        >>> import torch
        >>> from rlops.testing import check_logprobs
        >>> def logp_fn(logits, target, temperature):
        ...     z = torch.log_softmax(logits.float() / temperature, dim=-1)
        ...     return z.gather(-1, target[:, None])[:, 0]
        >>> report = check_logprobs(logp_fn, vocab_sizes=(100,), rows=8)
        >>> report.ok, report.failed
        (True, [])
    """
    tau, sizes, dts, n, dev, seed = _check_options(
        temperature, vocab_sizes, dtypes, rows, bitwise, device, seed
    )
    form = _temperature_form(fn)
    if form == "none" and tau != 1.0:
        raise ValueError(
            f"temperature={temperature} needs a function that takes the temperature; "
            f"{common.fn_name(fn)} takes (logits, target) only"
        )
    s = _Setup(fn, form, tau, sizes, dts, n, bool(bitwise), dev, seed)
    common.preflight(lambda: s.raw(*_inputs(2, 5, seed), tau), "the log-probs")
    shown = [] if form != "none" else ["temperature: not taken"]
    bodies = {name: (lambda body=body: body(s)) for name, body in _BODIES.items()}
    return common.run_checks("check_logprobs", fn, shown, _EXPLAIN, bodies)
