"""One pass over the vocabulary per step: ``linear_policy_loss`` against the two compositions.

    python benchmarks/linear_policy_loss.py                      # 4096 x 32000 x 512, float32
    python benchmarks/linear_policy_loss.py --threads 2 --dtype bfloat16

A PPO step's loss phase, forward + backward, on ``hidden [N, H]`` (as ``[8, N/8, H]``) and
``weight [V, H]`` leaves, with an entropy bonus (coef 0.01) and a token-mean PPO loss:

* ``materialised``: ``h @ W.T``, ``logprobs_and_entropy``, ``policy_loss``, ``entropy_loss``,
  backward (the ``[N, V]`` logits and their gradient exist);
* ``fused``: ``linear_logprobs_and_entropy``, then the same losses (the backward makes each
  chunk's logits again: four ``N×H×V`` matmuls);
* ``one pass``: ``linear_policy_loss`` (three matmuls, the gradients made in the forward).

Time: the median of interleaved calls in one fresh process (``time_in_fresh_process``). Memory:
the peak a fresh process adds over its inputs (``peak_in_fresh_process``). Ratios are against
``materialised`` and against ``fused``, from this run.
"""

from __future__ import annotations

import argparse

from rlops.measure.options import positive_int
from rlops.measure.timing import variants_in_fresh_processes
from rlops.measure.workloads import POLICY_STEPS, setup_policy_step

VARIANTS = POLICY_STEPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=4096)
    ap.add_argument("--v", type=positive_int, default=32000)
    ap.add_argument("--hidden", type=positive_int, default=512)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    n, v, h = args.n - args.n % 8, args.v, args.hidden
    shape = {"n": n, "v": v, "h": h, "dtype": args.dtype}
    tiny = {"n": 64, "v": 256, "h": 32, "dtype": args.dtype}
    got = variants_in_fresh_processes(
        setup_policy_step, VARIANTS, shape, tiny, threads=args.threads, repeats=args.repeats
    )
    mib = 1 << 20
    print(f"N x V x H = {n} x {v} x {h}, {args.dtype}, {args.threads} thread(s), PPO token-mean "
          "+ entropy bonus, forward + backward")  # fmt: skip
    head = (f"{'variant':13} {'time s':>7} {'x mat':>6} {'x fused':>7} | {'peak MiB':>8} "
            f"{'x mat':>6} {'x fused':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    (t_mat, p_mat), (t_fused, p_fused) = got["materialised"], got["fused"]
    for name, (t, p) in got.items():
        print(f"{name:13} {t:7.3f} {t / t_mat:6.2f} {t / t_fused:7.2f} | {p / mib:8.1f} "
              f"{p / p_mat:6.2f} {p / p_fused:7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
