"""Top-k distillation from hidden states: ``linear_distillation_loss`` against the materialised
path.

    python benchmarks/distillation.py                       # 4096 x 32000 x 256, k = 64, float32
    python benchmarks/distillation.py --threads 2 --tail

Forward + backward of a token-mean forward KL over the teacher's top-k, on ``hidden [N, H]``
and ``weight [V, H]`` leaves:

* ``materialised``: ``h @ W.T``, ``log_softmax``, gather, the divergence, backward (verl's
  default path: the ``[N, V]`` logits, their log-softmax and their gradients exist);
* ``logits op``: ``h @ W.T``, then ``distillation_loss`` (the logits exist, chunked rows after);
* ``linear op``: ``linear_distillation_loss`` (each chunk's logits made, used and dropped; made
  again in the backward).

Time: the median of interleaved calls in one fresh process. Memory: the peak a fresh process
adds over its inputs. Ratios are against ``materialised``, from this run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import rlops
from rlops.measure.options import positive_int
from rlops.measure.timing import variants_in_fresh_processes

VARIANTS = ("materialised", "logits op", "linear op")


def setup(n: int, v: int, h: int, k: int, variant: str, tail: bool = False) -> Callable[[], None]:
    """The loss step of ``variant`` on fresh leaves (the gradients dropped after each call)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * (4 / h**0.5)).requires_grad_()
    a, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    for r in range(0, n, 256):  # the teacher's top-k, never a [N, V] before the measurement
        top = torch.log_softmax(torch.randn(min(256, n - r), v, generator=gen) * 3, -1).topk(k, -1)
        a[r : r + 256], ids[r : r + 256] = top.values, top.indices

    def materialised() -> torch.Tensor:
        logp = torch.log_softmax(hidden @ weight.T, -1)
        s = logp.gather(-1, ids)
        loss = (a.exp() * (a - s)).sum(-1)
        if tail:
            pt, ps = 1 - a.exp().sum(-1), 1 - s.exp().sum(-1)
            loss = loss + pt * (pt.log() - ps.log())
        return loss

    def step() -> None:
        if variant == "materialised":
            loss = materialised()
        elif variant == "logits op":
            loss = rlops.distillation_loss(hidden @ weight.T, a, ids, tail=tail)[0]
        else:
            loss = rlops.linear_distillation_loss(hidden, weight, a, ids, tail=tail)[0]
        loss.mean().backward()
        hidden.grad = weight.grad = None

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=4096)
    ap.add_argument("--v", type=positive_int, default=32000)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--k", type=positive_int, default=64)
    ap.add_argument("--tail", action="store_true")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args()
    shape = {"n": args.n, "v": args.v, "h": args.hidden, "k": args.k, "tail": args.tail}
    tiny = {"n": 64, "v": 256, "h": 32, "k": min(args.k, 16), "tail": args.tail}
    got = variants_in_fresh_processes(
        setup, VARIANTS, shape, tiny, threads=args.threads, repeats=args.repeats
    )
    mib = 1 << 20
    print(f"N x V x H = {args.n} x {args.v} x {args.hidden}, k = {args.k}, float32, "
          f"{args.threads} thread(s), forward KL{' + tail' if args.tail else ''}, "
          "forward + backward")  # fmt: skip
    head = f"{'variant':13} {'time s':>7} {'x mat':>6} | {'peak MiB':>8} {'x mat':>6}"
    print(head)
    print("-" * len(head))
    t_mat, p_mat = got["materialised"]
    for name, (t, p) in got.items():
        print(f"{name:13} {t:7.3f} {t / t_mat:6.2f} | {p / mib:8.1f} {p / p_mat:6.2f}")


if __name__ == "__main__":
    main()
