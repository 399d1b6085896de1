"""Why TRL's trainer log-probs differ from its own generation's, diagnosed by rlops.

TRL samples with ``model.generate`` under its ``GRPOConfig`` settings (here temperature 0.7 and
top-k 5): transformers scales the logits by the temperature, keeps the top k and renormalises
before it samples. TRL's trainer then scores the same tokens with ``log_softmax(logits / T)``
over the whole vocabulary. This script runs TRL's generation call with its own
``generation_config`` (asking transformers for the processed scores it sampled from), takes
the log-prob of each sampled token under them, runs the model forward as the trainer does, and
hands both to ``rlops.testing.diagnose_mismatch``: the table ranks the explanations, the
verdict says what to set so the trainer's log-probs are the engine's.

    python examples/trl/consistency.py            # 8 prompts x 4 completions of 16 tokens
    python examples/trl/consistency.py --small    # 8 tokens (CI)

Needs the ``trl`` extra (TRL 1.16): ``pip install torch==2.13.0 -e '.[trl]'``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys

import torch
from grpo import make_trainer  # the same tiny Llama and TRL trainer as the GRPO example

TEMPERATURE, TOP_K = 0.7, 5


def generation_and_trainer_logprobs(trainer, completion: int):
    """TRL's generation (its ``generation_config``) with the scores it sampled from, then the
    trainer's forward: ``(engine_logprobs, logits, target, mask)`` over the completions."""
    tokenizer = trainer.processing_class
    prompts = ["say yes", "say no", "the cat", "a dog"] * 2  # one length: no left padding
    ids = tokenizer(prompts, return_tensors="pt").input_ids
    ids = ids.repeat_interleave(trainer.num_generations, dim=0)
    config = copy.deepcopy(trainer.generation_config)  # TRL's sampling settings
    config.max_new_tokens = completion
    config.output_scores = True  # the processed logits each token was sampled from
    config.return_dict_in_generate = True
    torch.manual_seed(0)
    model = trainer.model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
        )
        target = out.sequences[:, ids.shape[1] :]
        scores = torch.stack(out.scores, dim=1)  # [B, T, V], after temperature and top-k
        engine = torch.log_softmax(scores.double(), -1).gather(-1, target[..., None])[..., 0]
        # the trainer's forward over prompt + completion; row t scores completion token t
        logits = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]
    # tokens after the first EOS are padding (TRL masks them the same way)
    eos = (target == tokenizer.eos_token_id).int()
    mask = (eos.cumsum(-1) - eos) == 0
    return engine.masked_fill(~mask, 0.0), logits, target, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="8 tokens a completion")
    args = parser.parse_args()
    from rlops.testing import diagnose_mismatch

    trainer = make_trainer(1, temperature=TEMPERATURE, top_k=TOP_K)
    try:
        engine, logits, target, mask = generation_and_trainer_logprobs(
            trainer, 8 if args.small else 16
        )
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    report = diagnose_mismatch(engine, logits, target, mask, temperature=TEMPERATURE, top_k=TOP_K)
    print(report.table(shown=4))
    # what TRL's trainer computes: its fused head takes the temperature only
    trl = report["temperature, top-k not renormalised, float32 logits"]
    print(f"TRL's trainer, {trl.name}: mean |d| {trl.mean_abs_diff:.2e}, k3 KL {trl.kl:.2e}")


if __name__ == "__main__":
    sys.exit(main())
