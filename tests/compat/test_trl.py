"""rlops.compat.trl against TRL 1.16's own GRPOTrainer: the loss and its gradients, the
advantages, the rejected options.

The oracle is TRL's ``_compute_loss`` run in float64 (the model converted); the mixin's float32
loss and gradients must be within twice TRL's own float32 error of it (plus a few ulps), on a
batch with left-padded prompts, right-padded completions, a row without completion tokens and
old / reference log-probs moved so that clipping and the KL term fire.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from tests.tolerances import assert_within_reference

from rlops.compat import trl as rtrl

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

WORDS = "the cat sat on a mat and dog ran far away up down one two three four five".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"])
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _model(tokenizer, path=None, **config):
    """A tiny random Llama; saved to and loaded from ``path`` when given (TRL builds its
    reference model for beta > 0 from the model's path)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **config,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if path is None:
        return model
    model.save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(path)


def _reward_len(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def _reward_sometimes(completions, **kwargs):  # None: this completion is not scored
    return [None if i % 3 == 0 else float("a" in c) for i, c in enumerate(completions)]


class Trainer(rtrl.GRPOMixin, trl.GRPOTrainer):
    pass


def _trainer(
    tokenizer, tmp_path, cls=Trainer, model=None, reward_funcs=(_reward_len,), check=None, **options
):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-3,
        bf16=False,
        disable_tqdm=True,
    )
    args.update(options)
    ds = datasets.Dataset.from_dict({"prompt": ["the cat sat", "a dog ran"] * 4})
    extra = {} if check is None else {"check": check}
    if model is None:
        model = _model(tokenizer, tmp_path / "model" if options.get("beta") else None)
    return cls(
        model=model,
        reward_funcs=list(reward_funcs),
        args=trl.GRPOConfig(**args),
        train_dataset=ds,
        processing_class=tokenizer,
        **extra,
    )


def _as_trl(trainer):
    """TRL's own log-probs (a plain TRL trainer has them anyway)."""
    return getattr(trainer, "_rlops_as_trl", contextlib.nullcontext)()


def _batch(trainer, seed=0):
    """A GRPO micro-batch as _generate_and_score_completions returns it."""
    g = torch.Generator().manual_seed(seed)
    b, p, k, v = 8, 4, 6, trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, v, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # left padding
    prompt_ids[prompt_mask == 0] = trainer.processing_class.pad_token_id
    completion_ids = torch.randint(3, v, (b, k), generator=g)
    lengths = torch.tensor([6, 3, 5, 1, 6, 0, 4, 2])  # row 5: no completion token
    completion_mask = (torch.arange(k) < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = trainer.processing_class.pad_token_id
    with torch.no_grad(), _as_trl(trainer):
        ids = torch.cat([prompt_ids, completion_ids], 1)
        am = torch.cat([prompt_mask, completion_mask], 1)
        logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, k)[0]
    noise = torch.randn(b, k, generator=g)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": completion_mask.sum() * trainer.args.steps_per_generation,
        "old_per_token_logps": logp + 0.3 * noise,
        "ref_per_token_logps": logp - 0.2 * torch.randn(b, k, generator=g),
    }


def _loss_and_grads(trainer, inputs, use_trl):
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    if use_trl:
        with _as_trl(trainer):
            loss = trl.GRPOTrainer._compute_loss(trainer, model, inputs)
    else:
        loss = trainer._compute_loss(model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(params, grads, strict=True)
        ]
    )
    return loss.detach(), flat


CONFIGS = {
    "dapo": {},
    "grpo_temperature": {"loss_type": "grpo", "temperature": 0.7},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "cispo_default_cap": {"loss_type": "cispo"},  # TRL's epsilon_high 0.2: a cap below 1
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.3},
    "sapo": {"loss_type": "sapo"},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "clip_higher_delta": {"epsilon_high": 0.28, "delta": 1.5},
    "beta_kl": {"beta": 0.04},
    "beta_kl_no_bias_correction": {"beta": 0.04, "use_bias_correction_kl": False},
    "gspo_sequence": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "beta": 0.04,
    },
    "top_entropy_entropy_coef": {"top_entropy_quantile": 0.4, "entropy_coef": 0.01},
    "mask_truncated": {"loss_type": "grpo", "mask_truncated_completions": True},
    "grad_accum_2": {
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "steps_per_generation": 4,
    },
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_trl(tokenizer, tmp_path, name):
    options = dict(CONFIGS[name])
    trainer = _trainer(tokenizer, tmp_path, **options)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = _batch(trainer)
    trl_loss, trl_grad = _loss_and_grads(trainer, inputs, use_trl=True)
    ours_loss, ours_grad = _loss_and_grads(trainer, inputs, use_trl=False)
    trainer.model.double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    oracle_loss, oracle_grad = _loss_and_grads(trainer, inputs64, use_trl=True)
    assert torch.isfinite(ours_grad).all() and ours_grad.abs().max() > 0
    assert_within_reference(f"{name} loss", ours_loss, oracle_loss, trl_loss)
    assert_within_reference(f"{name} gradient", ours_grad, oracle_grad, trl_grad)


def test_patch_serves_trls_head(tokenizer, tmp_path):
    """patch(): TRL's own trainer (its log-probs, loss and entropy bonus) on rlops's linear op."""
    from trl.trainer import utils

    original = utils._ChunkedLogProbFunction
    trainer = _trainer(tokenizer, tmp_path, cls=trl.GRPOTrainer, beta=0.04, entropy_coef=0.01)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(trainer)
    trl_loss, trl_grad = _loss_and_grads(trainer, inputs, use_trl=True)
    rtrl.patch()
    try:
        assert utils._ChunkedLogProbFunction is not original
        ours_loss, ours_grad = _loss_and_grads(trainer, inputs, use_trl=True)
    finally:
        rtrl.patch(False)
    assert utils._ChunkedLogProbFunction is original
    trainer.model.double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    oracle_loss, oracle_grad = _loss_and_grads(trainer, inputs64, use_trl=True)
    assert_within_reference("patched loss", ours_loss, oracle_loss, trl_loss)
    assert_within_reference("patched gradient", ours_grad, oracle_grad, trl_grad)


def test_metrics_have_trl_names_and_values(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, beta=0.04, entropy_coef=0.01)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(trainer)
    with trainer._rlops_as_trl():
        trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    trainer._compute_loss(trainer.model, inputs)
    ours = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"scale_rewards": "batch", "reward_weights": [0.5, 2.0]},
        {"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "none"},
        {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0},
    ],
)
def test_training_step_checks_against_trl(tokenizer, tmp_path, options):
    """check=True compares the first advantages, loss and gradients with TRL's own, with
    unscorable (None) rewards from one of two reward functions (adaptive entropy: and the
    coefficient TRL's update leaves, applied once, not twice)."""
    trainer = _trainer(
        tokenizer, tmp_path, reward_funcs=(_reward_len, _reward_sometimes), check=True, **options
    )
    trainer.train()
    assert trainer._rlops_adv_checked and trainer._rlops_loss_checked
    logged = trainer.state.log_history[0]
    assert {"entropy", "clip_ratio/region_mean", "reward"} <= set(logged)
    if options.get("use_adaptive_entropy"):
        assert trainer.entropy_coef == pytest.approx(0.015, abs=1e-15)
        assert logged["entropy_coef"] == pytest.approx(0.015)
        assert 0 < trainer._last_world_entropy < 100


def _entropy_state(trainer, state=None):
    before = (trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats)
    if state is not None:
        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = state
    return before


@pytest.mark.parametrize(
    ("target", "last", "applied", "coef_after"),
    [
        (100.0, 0.1, True, 0.025),  # gated on, entropy below the target: raised
        (0.2, 0.1, True, 0.015),  # gated on, entropy above the target: lowered
        (100.0, math.inf, False, 0.025),  # no entropy measured yet: not applied
    ],
)
def test_adaptive_entropy_matches_trl(tokenizer, tmp_path, target, last, applied, coef_after):
    """use_adaptive_entropy: the loss and gradients with TRL's gated coefficient, and the
    coefficient and entropy TRL's update leaves, from the same state."""
    trainer = _trainer(
        tokenizer, tmp_path, use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=target
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(trainer)
    start = (0.02, last, None)
    _entropy_state(trainer, start)
    trl_loss, trl_grad = _loss_and_grads(trainer, inputs, use_trl=True)
    trl_after = _entropy_state(trainer, start)
    ours_loss, ours_grad = _loss_and_grads(trainer, inputs, use_trl=False)
    ours_after = _entropy_state(trainer, start)
    trainer.model.double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    oracle_loss, oracle_grad = _loss_and_grads(trainer, inputs64, use_trl=True)
    assert_within_reference("adaptive entropy loss", ours_loss, oracle_loss, trl_loss)
    assert_within_reference("adaptive entropy gradient", ours_grad, oracle_grad, trl_grad)
    assert trl_after[0] == pytest.approx(coef_after, abs=1e-15)
    assert ours_after[0] == trl_after[0]
    assert ours_after[1] == pytest.approx(trl_after[1], rel=1e-5)
    assert ours_after[2] is None and trl_after[2] is None
    # the bonus acts only when gated on: without it the loss differs
    _entropy_state(trainer, (0.02, math.inf if applied else 0.1, None))
    other = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs64).detach()
    assert (other != oracle_loss).item()


def test_check_raises_on_a_difference(tokenizer, tmp_path):
    class Off(Trainer):
        def _rlops_loss(self, model, inputs):
            return super()._rlops_loss(model, inputs) * 1.01

    with pytest.raises(RuntimeError, match="loss differs from TRL's"):
        _trainer(tokenizer, tmp_path, cls=Off, check=True).train()


@pytest.mark.parametrize(
    ("options", "config", "match"),
    [
        ({"loss_type": "vespo"}, {}, "loss_type='vespo'"),
        ({"use_adaptive_entropy": True, "entropy_coef_min": 2.0}, {}, "entropy_coef_min"),
        ({"use_adaptive_entropy": True, "entropy_coef_delta": -0.1}, {}, "entropy_coef_delta"),
        ({"off_policy_mask_threshold": 0.5}, {}, "off_policy_mask_threshold"),
        ({"delta": 1.1, "epsilon_high": 0.28}, {}, "delta=1.1"),
        ({}, {"final_logit_softcapping": -30.0}, "final_logit_softcapping"),
        ({}, {"logit_scale": 0.0}, "logit_scale"),
        ({}, {"logits_scaling": float("inf")}, "logits_scaling"),
    ],
)
def test_rejected_options_raise_naming_trl(tokenizer, tmp_path, options, config, match):
    model = _model(tokenizer)
    for k, v in config.items():
        setattr(model.config, k, v)
    with pytest.raises(ValueError, match=match):
        _trainer(tokenizer, tmp_path, model=model, **options)


# --------------------------------------------------------------------------- the functions
def test_advantages_by_hand():
    nan = math.nan
    # group [1, 0]: mean 0.5, std 0.7071 (Bessel); group [1, NaN]: one scored, std NaN -> 0
    got = rtrl.grpo_advantages(torch.tensor([1.0, 0.0, 1.0, nan]), 2)
    s = math.sqrt(0.5)
    torch.testing.assert_close(got, torch.tensor([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0, 0]))
    # scale_rewards="none": centred only; the scored member of a group of one is 0
    got = rtrl.grpo_advantages(torch.tensor([[3.0], [1.0], [nan], [2.0]]), 2, scale_rewards=False)
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # batch scaling, two weighted functions, a NaN in one function only (nansum)
    r = torch.tensor([[1.0, nan], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    got = rtrl.grpo_advantages(r, 2, reward_weights=[1.0, 2.0], scale_rewards="batch")
    total = torch.tensor([1.0, 2.0, 2.0, 0.0])
    centred = torch.tensor([-0.5, 0.5, 1.0, -1.0])
    torch.testing.assert_close(got, centred / (total.std() + 1e-4))


def test_advantages_normalize_then_sum_by_hand():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 3.0]])  # one group of 3, two functions
    got = rtrl.grpo_advantages(
        r, 3, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]
    )
    per_func = (r - r.mean(0)) / (r.std(0) + 1e-4)  # each function standardised in the group
    summed = per_func[:, 0] + 0.5 * per_func[:, 1]
    torch.testing.assert_close(got, (summed - summed.mean()) / (summed.std() + 1e-4))


def test_empty_rows_count_in_the_sequence_mean():
    """TRL's grpo divides by every row: a row without completion tokens halves the loss of a
    batch of two."""
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = rtrl.grpo_loss(logp, None, torch.tensor([2.0, 5.0]), mask, loss_type="grpo")
    assert loss.item() == pytest.approx(-2.0 / 2)  # on-policy: ratio 1, −A per token


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "vespo"}, "loss_type"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"delta": 1.1, "epsilon_high": 0.3}, "delta"),
        ({"importance_sampling_level": "row"}, "importance_sampling_level"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"top_entropy_quantile": 0.5}, "entropies"),
        ({"beta": 0.1}, "ref_per_token_logps"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"advantages": torch.zeros(3)}, "advantages"),
    ],
)
def test_grpo_loss_rejects(kwargs, match):
    logp = torch.zeros(2, 3)
    args = {"advantages": torch.zeros(2), **kwargs}
    adv = args.pop("advantages")
    with pytest.raises(ValueError, match=match):
        rtrl.grpo_loss(logp, None, adv, torch.ones(2, 3), **args)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.zeros(6), 4), {}, "num_generations"),
        ((torch.zeros(4), 2), {"scale_rewards": "row"}, "scale_rewards"),
        ((torch.zeros(4, 2), 2), {"reward_weights": [1.0]}, "reward_weights"),
        ((torch.zeros(4, 2, 1), 2), {}, "rewards_per_func"),
        ((torch.zeros(4), 2), {"multi_objective_aggregation": "mean"}, "multi_objective"),
    ],
)
def test_grpo_advantages_rejects(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rtrl.grpo_advantages(*args, **kwargs)


# --------------------------------------------------------------------------- softcapped heads
@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"final_logit_softcapping": 30.0}, {"logit_scale": 1.0, "final_logit_softcapping": 30.0}),
        ({"logit_scale": 0.0625}, {"logit_scale": 0.0625, "final_logit_softcapping": None}),
        ({"logits_scaling": 8.0}, {"logit_scale": 0.125, "final_logit_softcapping": None}),
        ({"lm_head_multiplier": 2.0}, {"logit_scale": 2.0, "final_logit_softcapping": None}),
        ({}, {"logit_scale": 1.0, "final_logit_softcapping": None}),
    ],
)
def test_head_options_are_read_as_trl_reads_them(config, want):
    from types import SimpleNamespace

    from rlops.compat.trl._head import head_options

    assert head_options(SimpleNamespace(model_type="x", **config))[0] == want


def test_softcapped_gemma2_log_probs_are_the_models_own():
    """The mixin's per-token log-probs and entropies of a tiny Gemma-2 (final softcap 3, so that
    it bites) equal ``log_softmax`` of the model's own softcapped ``logits / τ``."""
    from types import SimpleNamespace

    from rlops.compat.trl import GRPOMixin
    from rlops.compat.trl._head import head_options

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        final_logit_softcapping=3.0, attn_logit_softcapping=None, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg).double()
    torch.nn.init.normal_(model.lm_head.weight, std=2.0)  # logits well past the cap
    model.eval()
    assert head_options(model.config.get_text_config())[0]["final_logit_softcapping"] == 3.0
    fake = SimpleNamespace(
        _rlops_use_trl=False, _entropy_bonus_enabled=False, temperature=0.7,
        args=SimpleNamespace(cast_lm_head_to_fp32=False),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, autocast=contextlib.nullcontext),
    )  # fmt: skip
    ids = torch.randint(1, 40, (3, 9))
    am = torch.ones_like(ids)
    k = 5
    lp, ent, _ = GRPOMixin._get_per_token_logps_and_entropies(
        fake, model, ids, am, k, compute_entropy=True
    )
    logits = model(input_ids=ids, attention_mask=am).logits[:, -k - 1 : -1]
    assert float(logits.detach().abs().max()) > 2.0  # the cap is active
    logsm = torch.log_softmax(logits / 0.7, dim=-1)
    want_lp = logsm.gather(-1, ids[:, -k:, None])[..., 0]
    want_ent = -(logsm.exp() * logsm).sum(-1)
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)


def test_a_softcapped_gemma2_trains_with_check(tokenizer, tmp_path):
    """One step of a tiny Gemma-2 (final softcap 3) with ``check=True``: the loss and every
    gradient within the rule of TRL's own computation, which softcaps through the model."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        final_logit_softcapping=3.0, attn_logit_softcapping=None,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg)
    torch.nn.init.normal_(model.lm_head.weight, std=2.0)  # logits past the cap
    _trainer(tokenizer, tmp_path, model=model, check=True).train()
