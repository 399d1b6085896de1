"""Accuracy of the newer policy-loss kinds against a 40-digit evaluation of their definitions,
next to a plain float32 loop of the same formula.

    python benchmarks/kinds_error.py [--rows 8] [--len 257] [--seed 0]

For float32 and bfloat16 inputs (drawn in float64, then rounded: every column sees the same
inputs), per kind: the largest |ℓ| of the per-token loss, the largest absolute error of
``rlops.policy_loss(..., agg=None)`` against the 40-digit definition, that of a plain loop in
float32 (one token at a time, the formula as written in the paper), and that of the same loop in
the input dtype (for bfloat16: what a loop kept in bfloat16 gives). Then the same for the
``token-mean`` loss. The definitions are those of
``tests/losses/_references.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.losses._references import (
    CASES,
    Exact,
    Same,
    as_tensor,
    definition,
    inputs,
)

import rlops


def _mean(mat: torch.Tensor, mask: torch.Tensor) -> float:
    return float(mat.double().sum() / mask.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=257)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    head = (f"{'case':10} {'dtype':9} {'max|l|':>9} {'rlops':>9} {'loop f32':>9} "
            f"{'loop dt':>9} | {'mean rlops':>10} {'mean f32':>10} {'mean dt':>10}")
    print(head)
    print("-" * len(head))
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            logp, old, adv, mask = inputs(case, dtype, args.seed, b=args.rows, t=args.len)
            if case in ("gspo_dual", "luspo", "vespo", "sapo_seq", "cispo_seq"):
                adv = adv[:, :1].expand_as(adv).contiguous()  # one advantage per row
            kind, opts = CASES[case]
            got = rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=None, **opts)[0]
            exact = as_tensor(definition(case, logp, old, adv, mask, Exact))
            loop32 = as_tensor(definition(case, logp, old, adv, mask, Same(torch.float32)))
            loopdt = as_tensor(definition(case, logp, old, adv, mask, Same(dtype)))
            err = [float((x.double() - exact).abs().max()) for x in (got, loop32, loopdt)]
            ex_mean = _mean(exact, mask)
            mean_err = [abs(_mean(x, mask) - ex_mean) for x in (got, loop32, loopdt)]
            print(f"{case:10} {str(dtype)[6:]:9} {float(exact.abs().max()):9.3g} "
                  + " ".join(f"{e:9.2e}" for e in err) + " | "
                  + " ".join(f"{e:10.2e}" for e in mean_err))


if __name__ == "__main__":
    main()
