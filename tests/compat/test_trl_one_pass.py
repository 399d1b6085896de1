"""GRPOMixin's loss by ``linear_policy_loss`` in one pass over the vocabulary, where TRL's loss
allows it, against TRL 1.16's own ``_compute_loss``.

The oracle is TRL's loss and gradients in float64 (as in test_trl.py); the one pass must be
within twice TRL's own float32 error of it, log the metrics TRL logs with TRL's values, and a
configuration it does not serve must take the log-probs' path, with the same result as
``one_pass=False``.
"""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import assert_within_reference

import rlops.losses.linear

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from tests.compat.test_trl import (  # noqa: E402  (TRL is needed first)
    Trainer,
    _batch,
    _loss_and_grads,
    _reward_len,
    _reward_sometimes,
    _tokenizer,
    _trainer,
)

ENTROPY = {"entropy_coef": 0.01}
GA_2 = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
ONE_PASS = {
    "dapo_entropy": ENTROPY,
    "grpo_temperature": {"loss_type": "grpo", "temperature": 0.7},
    "bnpo_entropy": {"loss_type": "bnpo", **ENTROPY},
    "dr_grpo_entropy": {"loss_type": "dr_grpo", **ENTROPY},
    "luspo_token_entropy": {"loss_type": "luspo", **ENTROPY},
    "cispo_entropy": {"loss_type": "cispo", "epsilon_high": 1.3, **ENTROPY},
    "sapo": {"loss_type": "sapo"},
    "clip_higher_delta": {"epsilon_high": 0.28, "delta": 1.5},
    "dapo_grad_accum_2_entropy": {**GA_2, "steps_per_generation": 4, **ENTROPY},
    "bnpo_grad_accum_2_entropy": {"loss_type": "bnpo", **GA_2, **ENTROPY},
}
COMPOSED = {
    "beta_kl": {"beta": 0.04},
    "top_entropy": {"top_entropy_quantile": 0.4, **ENTROPY},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "cispo_cap_below_1": {"loss_type": "cispo"},
    "grpo_entropy": {"loss_type": "grpo", **ENTROPY},
    "sapo_entropy": {"loss_type": "sapo", **ENTROPY},
}


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture
def one_pass_calls(monkeypatch):
    """The calls of the one-pass op (under ``linear_policy_loss``) this test makes."""
    calls = []
    op = rlops.losses.linear.linear_logprobs_one_pass

    def spy(*args, **kwargs):
        calls.append(args[2].shape)
        return op(*args, **kwargs)

    monkeypatch.setattr(rlops.losses.linear, "linear_logprobs_one_pass", spy)
    return calls


def _step(trainer, inputs, one_pass):
    """The mixin's loss, gradients and logged metrics (``one_pass`` on or off)."""
    trainer._rlops_one_pass = one_pass
    trainer._metrics["train"].clear()
    loss, grad = _loss_and_grads(trainer, inputs, use_trl=False)
    return loss, grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _trl_step(trainer, inputs):
    trainer._metrics["train"].clear()
    loss, grad = _loss_and_grads(trainer, inputs, use_trl=True)
    return loss, grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _setup(tokenizer, tmp_path, options, batch):
    trainer = _trainer(tokenizer, tmp_path, **options)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = _batch(trainer)
    if batch == "on_policy":  # TRL's default: no old log-probs, the ratio is 1
        del inputs["old_per_token_logps"]
    elif batch == "no_num_items":
        del inputs["num_items_in_batch"]
    return trainer, inputs


def _float64_trl(trainer, inputs):
    """TRL's loss and gradients in float64 (the model converted): the oracle."""
    trainer.model.double()
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    return _loss_and_grads(trainer, wide, use_trl=True)


def _assert_metrics(ours, theirs):
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("batch", ["off_policy", "on_policy"])
@pytest.mark.parametrize("name", list(ONE_PASS))
def test_one_pass_matches_trl(tokenizer, tmp_path, one_pass_calls, name, batch):
    trainer, inputs = _setup(tokenizer, tmp_path, ONE_PASS[name], batch)
    trl_loss, trl_grad, trl_metrics = _trl_step(trainer, inputs)
    assert not one_pass_calls
    loss, grad, metrics = _step(trainer, inputs, True)
    assert one_pass_calls == [inputs["completion_ids"].shape]  # one call for the batch
    before_loss, before_grad, before_metrics = _step(trainer, inputs, False)
    assert len(one_pass_calls) == 1
    assert torch.isfinite(grad).all() and grad.abs().max() > 0
    oracle = _float64_trl(trainer, inputs)
    for what, ours, want, trls in zip(
        ("loss", "gradient"), (loss, grad), oracle, (trl_loss, trl_grad)
    ):
        assert_within_reference(f"{name} {what}", ours, want, trls)
    torch.testing.assert_close(loss, before_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, before_grad, rtol=1e-5, atol=1e-7)
    _assert_metrics(metrics, trl_metrics)
    _assert_metrics(metrics, before_metrics)


def test_dapo_without_num_items_in_batch(tokenizer, tmp_path, one_pass_calls):
    """dapo's token mean over the micro-batch (no ``num_items_in_batch``), with the bonus."""
    trainer, inputs = _setup(tokenizer, tmp_path, ENTROPY, "no_num_items")
    loss, grad, metrics = _step(trainer, inputs, True)
    assert len(one_pass_calls) == 1
    before_loss, before_grad, before_metrics = _step(trainer, inputs, False)
    torch.testing.assert_close(loss, before_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, before_grad, rtol=1e-5, atol=1e-7)
    _assert_metrics(metrics, before_metrics)


@pytest.mark.parametrize("name", list(COMPOSED))
def test_other_configurations_take_the_log_probs_path(tokenizer, tmp_path, one_pass_calls, name):
    trainer, inputs = _setup(tokenizer, tmp_path, COMPOSED[name], "off_policy")
    loss, grad, metrics = _step(trainer, inputs, True)
    before_loss, before_grad, before_metrics = _step(trainer, inputs, False)
    assert not one_pass_calls
    assert torch.equal(loss, before_loss) and torch.equal(grad, before_grad)
    assert metrics == pytest.approx(before_metrics, nan_ok=True)


def test_without_gradients_the_log_probs_path(tokenizer, tmp_path, one_pass_calls):
    """Evaluation (no gradients): the log-probs and TRL's loss, no gradients made."""
    trainer, inputs = _setup(tokenizer, tmp_path, ENTROPY, "off_policy")
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        trainer._rlops_one_pass = False
        before = trainer._compute_loss(trainer.model, inputs)
    assert not one_pass_calls
    assert torch.equal(loss, before)


class NoOnePass(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, one_pass=False, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "bnpo", **ENTROPY},
        {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0},
    ],
)
def test_training_step_checks_the_one_pass_against_trl(
    tokenizer, tmp_path, one_pass_calls, options
):
    """check=True: the one pass's first loss and gradients within TRL's own, then training."""
    reward_funcs = (_reward_len, _reward_sometimes)
    trainer = _trainer(tokenizer, tmp_path, reward_funcs=reward_funcs, check=True, **options)
    trainer.train()
    assert trainer._rlops_loss_checked and one_pass_calls
    assert {"entropy", "clip_ratio/region_mean"} <= set(trainer.state.log_history[0])
    one_pass_calls.clear()
    _trainer(tokenizer, tmp_path, cls=NoOnePass, reward_funcs=reward_funcs, **options).train()
    assert not one_pass_calls


@pytest.mark.parametrize("flag", ["one_pass", "check"])
@pytest.mark.parametrize("value", [1, "yes", None, torch.tensor(True)])
def test_the_mixin_flags_must_be_bools(flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got"):
        Trainer(**{flag: value})
