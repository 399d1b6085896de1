"""Top-k distillation from hidden states: ``linear_distillation_loss`` against verl's default
and chunked paths.

    python benchmarks/distillation.py                       # 4096 x 32000 x 256, k = 64, float32
    python benchmarks/distillation.py --threads 2 --tail

Forward + backward of a token-mean forward KL over the teacher's top-k, on ``hidden [N, H]``
and ``weight [V, H]`` leaves:

* ``materialised``: ``h @ W.T``, ``log_softmax``, gather, the divergence, backward (verl's
  default path: the ``[N, V]`` logits, their log-softmax and their gradients exist);
* ``verl chunked``: ``h @ W.T``, verl's ``use_chunked_topk`` path (gather minus a
  ``logsumexp`` per chunk of 4096 rows, under autograd); verl has no tail, so not with
  ``--tail``;
* ``logits op``: ``h @ W.T``, then ``distillation_loss`` (the logits exist, chunked rows after);
* ``linear op``: ``linear_distillation_loss`` (each chunk's logits made, used and dropped; made
  again in the backward).

Time: the median of interleaved calls in one fresh process. Memory: the peak a fresh process
adds over its inputs. Ratios are against ``materialised``, from this run.
"""

from __future__ import annotations

import argparse

from rlops.measure.options import positive_int
from rlops.measure.timing import variants_in_fresh_processes
from rlops.measure.workloads import DISTILLATION_STEPS, setup_distillation

VARIANTS = DISTILLATION_STEPS
NO_TAIL = ("verl chunked",)  # the variants without a tail


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
    variants = [v for v in VARIANTS if not (args.tail and v in NO_TAIL)]
    got = variants_in_fresh_processes(
        setup_distillation, variants, shape, tiny, threads=args.threads, repeats=args.repeats
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
