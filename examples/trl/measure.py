"""TRL's GRPO loss phase against TRL + rlops: differences per configuration, time and memory.

    python examples/trl/measure.py diffs                  # loss / gradient difference vs TRL
    python examples/trl/measure.py memory --vocab 32000 --completion 256
    python examples/trl/measure.py memory --vocab 64000 --completion 512 --step

``diffs``: for each configuration of ``tests/compat/test_trl.py``, on the same batch, the
mixin's loss and gradients against TRL's ``_compute_loss`` in float32 and against TRL's run
in float64 (the oracle), beside TRL's own float32 error.
``memory``: one process per variant (TRL alone, TRL + rlops): the median time of the loss
phase (``_compute_loss`` and its backward) over a few repeats and the rise of the peak RSS
over the RSS before it, for a tiny Llama (hidden 256, 2 layers) with ``--vocab`` words, 8
completions of ``--completion`` tokens after 16 prompt tokens. With ``--step``, the whole
training step after generation instead: the old log-probs (no gradient, with entropy, as TRL
computes them when the policy moves between generation and update), the loss phase with
``backward()`` and an AdamW step (generation and rewards left out: the same work on both sides).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/ (the configurations and the batch)


def diffs() -> None:
    import tests.compat.test_trl as t

    tokenizer = t._tokenizer()
    print(
        f"{'configuration':28s} {'|dloss| vs TRL':>15s} {'grad rel vs TRL':>16s} "
        f"{'ours vs f64':>12s} {'TRL vs f64':>12s}"
    )
    for name, options in t.CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            trainer = t._trainer(tokenizer, Path(tmp), **options)
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
            inputs = t._batch(trainer)
            trl_loss, trl_grad = t._loss_and_grads(trainer, inputs, use_trl=True)
            loss, grad = t._loss_and_grads(trainer, inputs, use_trl=False)
            trainer.model.double()
            inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
            _, grad64 = t._loss_and_grads(trainer, inputs64, use_trl=True)
        scale = float(grad64.abs().max())
        rel = float((grad - trl_grad).abs().max()) / float(trl_grad.abs().max())
        ours64 = float((grad.double() - grad64).abs().max()) / scale
        trl64 = float((trl_grad.double() - grad64).abs().max()) / scale
        print(
            f"{name:28s} {abs(float(loss - trl_loss)):15.2e} {rel:16.2e} {ours64:12.2e} "
            f"{trl64:12.2e}"
        )


def _one(variant: str, vocab: int, completion: int, repeats: int, step: bool = False) -> dict:
    """Runs in its own process: time and peak-RSS rise of the loss phase (or the whole step)."""
    import tests.compat.test_trl as t
    import transformers
    import trl

    tokenizer = t._tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=completion + 64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = t._trainer(tokenizer, Path(tmp), model=model, max_completion_length=completion)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    b, p = 8, 16
    g = torch.Generator().manual_seed(0)
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (b, p), generator=g),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (b, completion), generator=g),
        "completion_mask": torch.ones(b, completion, dtype=torch.long),
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": torch.tensor(b * completion),
    }
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

    def as_variant():
        return trainer._rlops_as_trl() if variant == "trl" else contextlib.nullcontext()

    def phase():
        with as_variant():
            if step:
                with torch.no_grad():
                    trainer._get_per_token_logps_and_entropies(
                        model, ids, attention, completion, compute_entropy=True
                    )
            if variant == "trl":
                loss = trl.GRPOTrainer._compute_loss(trainer, model, inputs)
            else:
                loss = trainer._compute_loss(model, inputs)
        if step:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            torch.autograd.grad(loss, params)

    import psutil

    before = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        phase()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "time_s": statistics.median(times),
        "peak_rise_mib": (max(peak, peak_before) - before) / 2**20,
    }


def memory(vocab: int, completion: int, repeats: int, step: bool) -> None:
    what = (
        "whole step after generation (old log-probs, loss, backward, AdamW)"
        if step
        else "loss phase (_compute_loss + backward)"
    )
    print(
        f"V = {vocab}, 8 x {completion} completion tokens, hidden 256, 2 layers, "
        f"{torch.get_num_threads()} threads; {what}"
    )
    for variant in ("trl", "rlops"):
        argv = ["one", variant, str(vocab), str(completion), str(repeats), str(int(step))]
        out = subprocess.run(
            [sys.executable, __file__, *argv],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  {'TRL' if variant == 'trl' else 'TRL + rlops':12s} median "
            f"{r['time_s'] * 1e3:8.1f} ms   peak RSS rise {r['peak_rise_mib']:7.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("diffs")
    m = sub.add_parser("memory")
    m.add_argument("--vocab", type=int, default=32000)
    m.add_argument("--completion", type=int, default=256)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--step", action="store_true", help="the whole step, not the loss phase")
    one = sub.add_parser("one")
    for name in ("variant", "vocab", "completion", "repeats", "step"):
        one.add_argument(name)
    args = parser.parse_args()
    if args.what == "diffs":
        diffs()
    elif args.what == "memory":
        memory(args.vocab, args.completion, args.repeats, args.step)
    else:
        r = _one(
            args.variant, int(args.vocab), int(args.completion), int(args.repeats), args.step == "1"
        )
        print(json.dumps(r))


if __name__ == "__main__":
    main()
