"""TRL's GRPOTrainer with rlops computing log-probs, advantages and loss: the one-line change.

A tiny random Llama and a word-level tokenizer trained here (nothing is downloaded), 10 GRPO
steps on CPU; the reward is the share of the word "yes" in the completion, so it rises.

    python examples/trl/grpo.py            # 10 steps
    python examples/trl/grpo.py --check    # the first step compared with TRL's own computation
    python examples/trl/grpo.py --small    # 2 steps (CI)

Needs the ``trl`` extra (TRL 1.16), installed from the checkout:
``pip install torch==2.13.0 -e '.[trl]'``. Without it the script exits 1, saying so.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

import torch

# --------------------------------------------------------------------------- config
STEPS = 10
HIDDEN, LAYERS, HEADS = 32, 2, 4
PROMPTS = ["say yes", "say no", "one two three", "the cat sat", "a dog ran", "up and down"]
WORDS = "yes no one two three four five the cat sat on a mat dog ran up and down say".split()
GENERATIONS, BATCH, COMPLETION = 4, 8, 8  # completions per prompt, per step, tokens


def make_trainer(steps: int, check: bool = False, **options):
    """TRL's GRPOTrainer behind rlops' mixin, on a tiny random Llama and a word-level tokenizer;
    ``options`` go to ``GRPOConfig`` (``temperature``, ``top_k``, ...)."""
    try:
        import transformers
        import trl
        from datasets import Dataset
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError as e:
        sys.exit(
            f"{e}: this example needs the trl extra; from the checkout, "
            "pip install torch==2.13.0 -e '.[trl]'"
        )
    from rlops.compat.trl import GRPOMixin

    # the one-line change: rlops's mixin first, then TRL's trainer
    class Trainer(GRPOMixin, trl.GRPOTrainer):
        pass

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<pad>", "<eos>"]
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)

    def reward_yes(completions, **kwargs):
        return [c.split().count("yes") / max(len(c.split()), 1) for c in completions]

    grpo_args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,  # float32 on CPU (TRL's default autocasts to bfloat16)
        **options,
    )
    return Trainer(
        model=model,
        reward_funcs=reward_yes,
        args=grpo_args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=tokenizer,
        check=check,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="2 steps")
    parser.add_argument("--check", action="store_true", help="compare the first step with TRL")
    args = parser.parse_args()
    trainer = make_trainer(2 if args.small else STEPS, check=args.check)
    try:
        trainer.train()
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    for log in trainer.state.log_history:
        if "reward" in log:
            print(
                f"step {log['step']:2d}  loss {log['loss']:+.4f}  reward {log['reward']:.3f}  "
                f"entropy {log['entropy']:.3f}  clip {log['clip_ratio/region_mean']:.3f}"
            )
    if args.check:
        print("check: the first step's advantages, loss and gradients equal TRL's")


if __name__ == "__main__":
    sys.exit(main())
