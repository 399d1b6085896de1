"""Float32 logits from bfloat16 operands: accuracy, peak memory and time of three ways.

    python benchmarks/logits_dtype.py                        # N x V x H = 256 x 32768 x 1024
    python benchmarks/logits_dtype.py --n 4096 --threads 2

On bfloat16 ``hidden [N, H]`` and ``weight [V, H]`` (logits of std ~4), the log-probs and
entropies of ``linear_logprobs_and_entropy`` by:

* ``bf16 logits``: the default (the logits rounded to bfloat16 before the softmax);
* ``logits_dtype=f32``: ``logits_dtype=torch.float32`` (float32 logits, the weight upcast by
  blocks of its rows, never whole);
* ``cast weight``: ``hidden.float()``, ``weight.float()`` in the step, then the float32 op
  (a float32 copy of the weight per call, as a trainer whose head is cast does).

Error: the max abs error of the log-prob and the entropy against float64 on the same bfloat16
operands. Memory: the peak resident set a fresh process adds over its inputs
(``rlops.measure.timing.peak_in_fresh_process``) for the forward alone without gradients
(``fwd``) and for forward + backward (``f+b``: gradients of both inputs, random upstream
gradients; its float32 accumulator of the weight's gradient is there in every variant). Time:
forward + backward, the median of interleaved calls in one fresh process
(``time_in_fresh_process``). Ratios are against ``bf16 logits`` and
against ``cast weight``, from this run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import rlops
from rlops.measure.options import positive_int
from rlops.measure.timing import peak_in_fresh_process, time_in_fresh_process

VARIANTS = ("bf16 logits", "logits_dtype=f32", "cast weight")


def _inputs(n: int, v: int, h: int):
    """Drawn in bfloat16 (no float32 temporary to raise the memory high-water before a step)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(v, h, generator=gen, dtype=torch.bfloat16).mul_(4 / h**0.5)
    target = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, target


def _call(variant: str, hidden, weight, target):
    if variant == "cast weight":
        return rlops.linear_logprobs_and_entropy(hidden.float(), weight.float(), target)
    wide = torch.float32 if variant == "logits_dtype=f32" else None
    return rlops.linear_logprobs_and_entropy(hidden, weight, target, logits_dtype=wide)


def setup(n: int, v: int, h: int, variant: str, backward: bool = True) -> Callable[[], None]:
    """The step of ``variant``: forward + backward on bfloat16 leaves, or (``backward=False``)
    the forward alone without gradients (old log-probs, a reference model)."""
    hidden, weight, target = _inputs(n, v, h)
    hidden.requires_grad_(backward)
    weight.requires_grad_(backward)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]

    def step() -> None:
        if not backward:
            with torch.no_grad():
                _call(variant, hidden, weight, target)
            return
        torch.autograd.backward(list(_call(variant, hidden, weight, target)), grads)
        hidden.grad = weight.grad = None

    return step


def _errors(n: int, v: int, h: int) -> dict[str, tuple[float, float]]:
    hidden, weight, target = _inputs(n, v, h)
    log_p = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    lp64 = log_p.gather(1, target[:, None])[:, 0]
    ent64 = -(log_p.exp() * log_p).sum(dim=-1)
    del log_p
    out = {}
    with torch.no_grad():
        for variant in VARIANTS:
            lp, ent = _call(variant, hidden, weight, target)
            out[variant] = (
                float((lp.double() - lp64).abs().max()),
                float((ent.double() - ent64).abs().max()),
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=256)
    ap.add_argument("--v", type=positive_int, default=32768)
    ap.add_argument("--hidden", type=positive_int, default=1024)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args()
    n, v, h = args.n, args.v, args.hidden
    torch.set_num_threads(args.threads)
    errors = _errors(n, v, h)
    tiny = {"n": 16, "v": 256, "h": 32}
    setups = {
        name: (setup, {"n": n, "v": v, "h": h, "variant": name}, {**tiny, "variant": name})
        for name in VARIANTS
    }
    peaks = {
        name: peak_in_fresh_process(fn, kw, prime_kwargs=prime, threads=args.threads)
        for name, (fn, kw, prime) in setups.items()
    }
    no_grad = {"backward": False}
    forward = {
        name: peak_in_fresh_process(
            fn, {**kw, **no_grad}, prime_kwargs={**prime, **no_grad}, threads=args.threads
        )
        for name, (fn, kw, prime) in setups.items()
    }
    times = time_in_fresh_process(setups, [args.threads], repeats=args.repeats)
    mib = 1 << 20
    print(f"N x V x H = {n} x {v} x {h}, bfloat16 operands, {args.threads} threads; weight "
          f"{v * h * 2 / mib:.0f} MiB (float32 copy {v * h * 4 / mib:.0f} MiB)")  # fmt: skip
    head = (f"{'variant':17} {'err logp':>8} {'err ent':>8} | {'fwd MiB':>7} {'x bf16':>6} "
            f"{'x cast':>6} | {'f+b MiB':>7} {'x bf16':>6} {'x cast':>6} | {'f+b s':>6} "
            f"{'x bf16':>6} {'x cast':>6}")  # fmt: skip
    print(head)
    print("-" * len(head))
    base, cast = VARIANTS[0], VARIANTS[2]
    for name in VARIANTS:
        e_lp, e_ent = errors[name]
        cols = [f"{name:17} {e_lp:8.1e} {e_ent:8.1e}"]
        for by in (forward, peaks):
            cols.append(f"{by[name] / mib:7.1f} {by[name] / by[base]:6.2f} "
                        f"{by[name] / by[cast]:6.2f}")  # fmt: skip
        t = {key: times[key][args.threads] for key in VARIANTS}
        cols.append(f"{t[name]:6.2f} {t[name] / t[base]:6.2f} {t[name] / t[cast]:6.2f}")
        print(" | ".join(cols))


if __name__ == "__main__":
    main()
