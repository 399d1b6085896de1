"""The log-prob contract: :func:`check_logprobs`."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

from rlops.logprobs.reference import logprobs_and_entropy_reference
from rlops.testing._common import Measured, generator, measure, run_checks
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
    "half precision): the ratio against the sampler's log-probs is biased",
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


def _keyword_only(fn: Callable) -> bool:
    """Whether ``fn`` takes ``temperature`` only as a keyword: a keyword-only ``temperature``,
    or a ``**options`` and no third positional parameter to take it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    p = params.get("temperature")
    if p is not None:
        return p.kind is p.KEYWORD_ONLY
    kinds = [q.kind for q in params.values()]
    positional = sum(
        k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for k in kinds
    )
    return (
        inspect.Parameter.VAR_KEYWORD in kinds
        and positional < 3
        and (inspect.Parameter.VAR_POSITIONAL not in kinds)
    )


def _call(
    fn: Callable, logits: torch.Tensor, target: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fn``'s ``(logp [N], entropy [N] | None)``, its shapes checked. The temperature goes
    by keyword where ``fn`` takes it only so (``rlops.logprobs_and_entropy`` itself)."""
    if _keyword_only(fn):
        out = fn(logits, target, temperature=temperature)
    else:
        out = fn(logits, target, temperature)
    logp, ent = (
        (out[0], out[1] if len(out) > 1 else None)
        if isinstance(out, (tuple, list))
        else (out, None)
    )
    n = target.shape[0]
    for name, t in (("logp", logp), ("entropy", ent)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the function's {name} must be a tensor, got {type(t).__name__}")
        if t.numel() != n:
            raise ValueError(f"the function's {name} has shape {tuple(t.shape)}, expected [{n}]")
    return logp.reshape(n), None if ent is None else ent.reshape(n)


def _definition(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference log-prob and entropy of ``logits``' values computed in ``dtype``
    (float64: the definition; the input dtype: the plain computation), on the CPU
    (differentiable)."""
    z = logits.to("cpu", dtype)
    out = logprobs_and_entropy_reference(z, target.to("cpu"), temperature=temperature)
    logp, ent = out[0], out[1]
    assert ent is not None
    return logp, ent


def _plain(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
    out: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain computation in the logits' dtype (float32 for half logits, as torch's own
    ``log_softmax`` accumulates), rounded to the dtype the function returns."""
    logp, ent = _definition(logits, target, temperature, logits.dtype)
    ent_dtype = out[1].dtype if out[1] is not None else ent.dtype
    return logp.to(out[0].dtype), ent.to(ent_dtype)


def _compare(
    out: tuple[torch.Tensor, torch.Tensor | None],
    ref: tuple[torch.Tensor, ...],
    plain: tuple[torch.Tensor, ...],
) -> list[tuple[str, Measured]]:
    """The rule on the log-prob and, where the function returns one, the entropy."""
    found = [("logp", measure(out[0], ref[0], plain[0]))]
    if out[1] is not None:
        found.append(("entropy", measure(out[1], ref[1], plain[1])))
    return found


def _worst(found: list[tuple[str, Measured]]) -> tuple[bool, float, str]:
    ok = all(m.ok for _, m in found)
    name, m = max(found, key=lambda f: (not f[1].ok, f[1].err / max(f[1].bound, 1e-300)))
    return ok, m.err, f"{name} {m.text()}"


def _inputs(n: int, v: int, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(seed)
    logits = torch.randn(n, v, generator=g) * scale
    target = torch.randint(0, v, (n,), generator=g)
    return logits, target


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
    None)`` (a keyword-only ``temperature`` is passed by keyword), where
    ``logp = log_softmax(logits / temperature)[target]`` and
    ``entropy = −Σ_v p_v·log p_v`` with ``p = softmax(logits / temperature)``. The definition
    is :func:`rlops.logprobs.reference.logprobs_and_entropy_reference` in float64; the rule for
    an output in dtype ``d``: every element within ``2·e + 4 ulps`` of the definition, ``e``
    the largest error of the plain computation (the same reference in the logits' dtype,
    float32 for half logits, rounded to ``d``) on the same inputs.

    Checks (in this order, with these names):

    * ``values``: random logits ``[rows, V]`` for each of ``vocab_sizes`` and ``dtypes``.
    * ``vocab_tail``: odd vocabularies (5, 257, 1031 and the odd ones of ``vocab_sizes``:
      a multiple of no tile size) with the row's largest logits and the targets among the
      last entries.
    * ``gradients``: the gradient of ``Σ g·logp + Σ h·entropy`` (random ``g``, ``h``)
      reaches the logits and equals the definition's, within the rule.
    * ``temperature``: at τ = 0.5 and 2 (and ``temperature``) the result is the definition's
      at τ, not at 1 or τ² (applied once).
    * ``batch_invariance``: each row's result is the same alone, in the first rows, in a
      reversed batch, in a larger batch and beside padding rows (zeros, and logits of 100):
      the largest difference is within the rule, or exactly 0 with ``bitwise=True``.
    * ``masked_vocab``: a quarter of each row's logits (never the target) at −inf, one row
      with only two finite entries: finite results (and gradients) within the rule of the
      definition on the finite entries.
    * ``large_logits``: logits of magnitude up to 1e4 (rows all at 1e4, at −1e4, one at 1e4
      among −1e4): finite and within the rule.
    * ``low_precision``: bfloat16 logits for each of ``vocab_sizes``, within the rule.

    Args:
        fn: the function under test.
        temperature: τ used by every check but ``temperature``.
        vocab_sizes: the vocabularies of ``values`` and ``low_precision`` (the first also of
            the other checks).
        dtypes: the logits' dtypes of ``values`` (the first also of the other checks).
        rows: ``N`` of each check's batch.
        bitwise: whether ``batch_invariance`` demands identical bits.
        device: where the inputs are made (the function's device); the definitions run on
            the CPU in float64.
        seed: the seed of every input (the same seed gives the same inputs).

    Returns:
        a :class:`rlops.testing.Report` with the eight checks above.

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
    dev = torch.device(device)
    v0, dt0 = vocab_sizes[0], dtypes[0]

    def call(logits: torch.Tensor, target: torch.Tensor, tau: float = temperature):
        return _call(fn, logits.to(dev), target.to(dev), tau)

    def against_definition(logits: torch.Tensor, target: torch.Tensor, tau: float = temperature):
        out = call(logits, target, tau)
        return _compare(out, _definition(logits, target, tau), _plain(logits, target, tau, out))

    def values():
        found = []
        for i, v in enumerate(vocab_sizes):
            for dt in dtypes:
                logits, target = _inputs(rows, v, seed + i)
                for name, m in against_definition(logits.to(dt), target):
                    found.append((f"V={v} {str(dt).removeprefix('torch.')} {name}", m))
        return _worst(found)

    def vocab_tail():
        found = []
        sizes = sorted({5, 257, 1031} | {v for v in vocab_sizes if v % 2})
        for i, v in enumerate(sizes):
            logits, _ = _inputs(rows, v, seed + 10 + i, scale=2.0)
            k = min(3, v)
            logits[:, v - 1] += 6.0  # the largest logit of every row is the very last entry
            target = v - 1 - torch.arange(rows) % k
            for name, m in against_definition(logits.to(dt0), target):
                found.append((f"V={v} {name}", m))
        return _worst(found)

    def gradients():
        logits, target = _inputs(rows, v0, seed + 20)
        up = torch.randn(2, rows, generator=generator(seed + 21))
        z = logits.to(dev, dt0).requires_grad_(True)
        logp, ent = _call(fn, z, target.to(dev), temperature)
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
        grads = []
        for dt in (torch.float64, dt0):
            zr = logits.to(dt).requires_grad_(True)
            grads.append(grad_of(zr, *_definition(zr, target, temperature, dt)))
        m = measure(got, grads[0], grads[1])
        what = "d(logp, entropy)/dlogits" if with_ent else "dlogp/dlogits"
        return m.ok, m.err, f"{what} {m.text()}"

    def temperature_once():
        taus = sorted({0.5, 2.0} | ({temperature} if temperature != 1.0 else set()))
        logits, target = _inputs(rows, v0, seed + 30)
        logits = logits.to(dt0)
        parts, ok, worst = [], True, 0.0
        for tau in taus:
            out = call(logits, target, tau)
            found = _compare(
                out, _definition(logits, target, tau), _plain(logits, target, tau, out)
            )
            fit = max(m.err / max(m.bound, 1e-300) for _, m in found)
            worst = max(worst, fit)
            if fit <= 1.0:
                parts.append(f"tau={tau}: applied once")
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
            parts.append(f"tau={tau}: {said} (error {fit:.1f} x bound at tau)")
        return ok, worst, "; ".join(parts) + f" (largest error/bound {worst:.2f})"

    def batch_invariance():
        logits, target = _inputs(16, v0, seed + 40)
        logits = logits.to(dt0)
        base = call(logits, target)
        bound = max(
            m.bound
            for _, m in _compare(
                base,
                _definition(logits, target, temperature),
                _plain(logits, target, temperature, base),
            )
        )
        g = generator(seed + 41)
        extra, extra_t = _inputs(51, v0, seed + 42)
        pad = torch.cat(
            [torch.zeros(8, v0), torch.full((8, v0), 100.0) + torch.randn(8, v0, generator=g)]
        ).to(dt0)
        pad_t = torch.zeros(16, dtype=target.dtype)
        # (label, logits, target, positions of base rows idx in the batch, idx)
        every = torch.arange(16)
        cases: list[tuple[str, torch.Tensor, torch.Tensor, object, object]] = [
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
            out = call(z, t)
            for a, b in zip(out, base, strict=True):
                if a is None or b is None:
                    continue
                d = (a.detach().cpu().double()[pos] - b.detach().cpu().double()[idx]).abs()
                diff = float(torch.where(torch.isnan(d), math.inf, d).max())
                if diff > worst:
                    worst, where = diff, label
        bitwise_same = worst == 0.0
        ok = bitwise_same if bitwise else worst <= bound
        rule = "bitwise demanded" if bitwise else f"bound {bound:.2e}"
        said = "bitwise identical" if bitwise_same else f"worst: {where}"
        return (
            ok,
            worst,
            (
                f"largest difference {worst:.2e} ({said}; {rule}) over N in "
                "{1, 5, 16, 32, 67}, reversed, padding rows"
            ),
        )

    def masked_vocab():
        logits, target = _inputs(rows, v0, seed + 50)
        g = generator(seed + 51)
        masked = torch.rand(rows, v0, generator=g) < 0.25
        masked[0] = True
        masked[0, torch.randperm(v0, generator=g)[:2]] = False
        masked[torch.arange(rows), target] = False
        logits = logits.masked_fill(masked, -math.inf).to(dt0)
        z = logits.to(dev).requires_grad_(True)
        out = _call(fn, z, target.to(dev), temperature)
        refs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        plains: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i in range(rows):  # the definition on each row's finite entries
            kept = ~masked[i]
            zi = logits[i, kept][None]
            ti = kept[: target[i]].sum()[None]
            for dst, dt in ((refs, torch.float64), (plains, zi.dtype)):
                lp, en = _definition(zi, ti, temperature, dt)
                dst[0].append(lp)
                dst[1].append(en)
        ref = (torch.cat(refs[0]), torch.cat(refs[1]))
        plain = (
            torch.cat(plains[0]).to(out[0].dtype),
            torch.cat(plains[1]).to(out[1].dtype if out[1] is not None else torch.float64),
        )
        ok, value, figure = _worst(_compare(out, ref, plain))
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

    def large_logits():
        logits, target = _inputs(rows, v0, seed + 60, scale=2500.0)
        logits = logits.clamp(-1e4, 1e4)
        logits[0] = 1e4
        logits[1] = -1e4
        logits[1, target[1]] = 1e4
        logits[2] = -1e4
        logits[3, :] = 1e4
        logits[3, target[3]] = -1e4
        return _worst(against_definition(logits.to(dt0), target))

    def low_precision():
        found = []
        for i, v in enumerate(vocab_sizes):
            logits, target = _inputs(rows, v, seed + 70 + i)
            for name, m in against_definition(logits.to(torch.bfloat16), target):
                found.append((f"V={v} {name}", m))
        return _worst(found)

    bodies = {
        "values": values,
        "vocab_tail": vocab_tail,
        "gradients": gradients,
        "temperature": temperature_once,
        "batch_invariance": batch_invariance,
        "masked_vocab": masked_vocab,
        "large_logits": large_logits,
        "low_precision": low_precision,
    }
    return run_checks("check_logprobs", fn, [], LOGPROB_CHECKS, _EXPLAIN, bodies)
