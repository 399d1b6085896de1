"""float32 accuracy of the distillation ops: the largest error against float64, per kind.

    python benchmarks/distillation_accuracy.py [--n 512] [--v 4096] [--h 64] [--k 64]

For every kind × teacher (top-k with and without the tail bucket, full) the per-token loss and
the gradient of the hidden states (a random upstream weight per token) from float32 inputs are
compared with the same op's float64 result on the same (float32-representable) inputs:
``distillation_loss`` on ``h @ W.T``, ``linear_distillation_loss`` and, for scale, the plain
definition in float32 (``log_softmax``, gather, the divergence's formula). Printed: the largest
absolute error of the losses, and of the hidden gradient relative to its largest entry.
"""

from __future__ import annotations

import argparse

import torch

import rlops
from rlops.measure.options import positive_int


def definition(logits, a, ids, kind, tail, beta=0.5):
    """The divergence written plainly (top-k ids, or the full teacher with ``ids`` None)."""
    logp = torch.log_softmax(logits, -1)
    b = logp if ids is None else logp.gather(-1, ids)
    pt, ps = a.exp(), b.exp()
    if tail:
        pt = torch.cat([pt, (1 - pt.sum(-1, keepdim=True)).clamp_min(0)], -1)
        ps = torch.cat([ps, (1 - ps.sum(-1, keepdim=True)).clamp_min(0)], -1)
    lt, ls = pt.log(), ps.log()
    if kind == "forward_kl":
        terms = torch.where(pt > 0, pt * (lt - ls), 0)
    elif kind == "reverse_kl":
        terms = torch.where(ps > 0, ps * (ls - lt), 0)
    else:
        m = beta * pt + (1 - beta) * ps
        lm = m.log()
        terms = beta * torch.where(pt > 0, pt * (lt - lm), 0)
        terms = terms + (1 - beta) * torch.where(ps > 0, ps * (ls - lm), 0)
    return terms.sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=512)
    ap.add_argument("--v", type=positive_int, default=4096)
    ap.add_argument("--h", type=positive_int, default=64)
    ap.add_argument("--k", type=positive_int, default=64)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.h, generator=g)
    weight = torch.randn(args.v, args.h, generator=g) * 2 * args.h**-0.5
    teacher = torch.log_softmax(torch.randn(args.n, args.v, generator=g) * 3, -1)
    top = teacher.topk(args.k, -1)
    w_out = torch.randn(args.n, generator=g)
    print(f"N x V x H = {args.n} x {args.v} x {args.h}, k = {args.k}: float32 error against "
          "float64 (loss: absolute; hidden gradient: relative to its largest entry)")  # fmt: skip
    head = f"{'kind':11} {'teacher':11} | {'op':>17} {'linear op':>17} {'definition':>17}"
    print(head)
    print("-" * len(head))
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        for name, full, tail in (("top-k", False, False), ("top-k+tail", False, True),
                                 ("full", True, False)):  # fmt: skip
            a32 = teacher if full else top.values
            ids = None if full else top.indices
            kw = {"kind": kind, "tail": tail}
            ops = {
                "op": lambda h, w, a, kw=kw, ids=ids: rlops.distillation_loss(
                    h @ w.T, a, ids, **kw)[0],
                "linear op": lambda h, w, a, kw=kw, ids=ids: rlops.linear_distillation_loss(
                    h, w, a, ids, **kw)[0],
                "definition": lambda h, w, a, kind=kind, ids=ids, tail=tail: definition(
                    h @ w.T, a, ids, kind, tail),
            }  # fmt: skip
            cells = []
            for op in ops.values():
                out = {}
                for dt in (torch.float32, torch.float64):
                    h = hidden.to(dt).clone().requires_grad_()
                    loss = op(h, weight.to(dt), a32.to(dt))
                    (loss * w_out.to(dt)).sum().backward()
                    out[dt] = (loss.detach().double(), h.grad.double())
                (l32, g32), (l64, g64) = out[torch.float32], out[torch.float64]
                err_l = (l32 - l64).abs().max().item()
                err_g = ((g32 - g64).abs().max() / g64.abs().max()).item()
                cells.append(f"{err_l:8.1e} {err_g:8.1e}")
            print(f"{kind:11} {name:11} | " + " ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
