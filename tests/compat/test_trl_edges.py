"""rlops.compat.trl at its edges: errors that name TRL's options, ``top_entropy_quantile=0``
as TRL documents it, float64 advantages with float64 accuracy, non-finite ``reward_weights``
rejected, and ``GRPOMixin`` placed wrongly in the bases.

Expected values come from the definitions: TRL 1.16's documentation and its own functions
where TRL is installed, ``statistics`` for the standard deviation, and the loss written out by
hand for on-policy tokens (ratio 1, inside the clip: a token's loss is ``−A``).
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlops.compat import trl as rtrl

NAN, INF = math.nan, math.inf
#: rlops's own argument names that TRL's users never wrote (the leaks this file guards)
INTERNAL = re.compile(
    r"\b(loss_scale_factor|num_tokens|tau_pos|tau_neg|coef|rho|clip_low|"
    r"clip_high|dual_clip)\b"
)


# --------------------------------------------------------------------------- option errors
def _loss(**kwargs):
    """grpo_loss on a small on-policy batch, with ``kwargs`` over the defaults."""
    logp = torch.zeros(2, 3, requires_grad=True)
    args = {"entropies": torch.rand(2, 3), "ref_per_token_logps": torch.zeros(2, 3), **kwargs}
    return rtrl.grpo_loss(logp, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3), **args)


# (TRL option, value, other options, error type, the expected range as the message states it)
OPTION_ERRORS = [
    ("max_completion_length", 0, {"loss_type": "dr_grpo"}, ValueError, ">= 1"),
    ("max_completion_length", -4, {"loss_type": "dr_grpo"}, ValueError, ">= 1"),
    ("max_completion_length", 2.5, {"loss_type": "dr_grpo"}, TypeError, "an int"),
    ("max_completion_length", None, {"loss_type": "dr_grpo"}, ValueError, "an int >= 1"),
    ("num_processes", 0, {"num_items_in_batch": 6}, ValueError, ">= 1"),
    ("num_processes", 0, {"loss_type": "cispo", "num_items_in_batch": 6}, ValueError, ">= 1"),
    ("num_processes", 1.5, {"num_items_in_batch": 6}, TypeError, "an int"),
    ("steps_per_generation", 0, {"num_items_in_batch": 6}, ValueError, ">= 1"),
    ("gradient_accumulation_steps", 0, {}, ValueError, ">= 1"),
    ("num_items_in_batch", -3, {}, ValueError, ">= 0"),
    ("num_items_in_batch", NAN, {}, ValueError, ">= 0"),
    ("num_items_in_batch", torch.tensor(NAN), {}, ValueError, ">= 0"),
    ("top_entropy_quantile", -0.1, {}, ValueError, "[0, 1]"),
    ("top_entropy_quantile", 1.5, {}, ValueError, "[0, 1]"),
    ("top_entropy_quantile", NAN, {}, ValueError, "[0, 1]"),
    ("epsilon", 0.0, {}, ValueError, "> 0"),
    ("epsilon_high", -0.2, {}, ValueError, "> 0"),
    ("delta", NAN, {}, ValueError, "> 0"),
    ("beta", NAN, {}, ValueError, ">= 0"),
    ("beta", -0.1, {}, ValueError, ">= 0"),
    ("entropy_coef", INF, {}, ValueError, "finite"),
    ("entropy_coef", NAN, {}, ValueError, "finite"),
    ("sapo_temperature_pos", INF, {"loss_type": "sapo"}, ValueError, "finite"),
    ("sapo_temperature_neg", 0.0, {"loss_type": "sapo"}, ValueError, "> 0"),
]


@pytest.mark.parametrize(
    ("option", "value", "others", "error", "expected"),
    OPTION_ERRORS,
    ids=[f"{o}={v}-{x.get('loss_type', 'dapo')}" for o, v, x, _, _ in OPTION_ERRORS],
)
def test_grpo_loss_errors_name_trls_option(option, value, others, error, expected):
    with pytest.raises(error) as info:
        _loss(**others, **{option: value})
    msg = str(info.value)
    assert option in msg, msg
    assert expected in msg, msg
    if value is not None:  # the value received (its type for a TypeError)
        shown = type(value).__name__ if error is TypeError else str(float(value)).rstrip("0")
        assert shown.rstrip(".") in msg, msg
    assert not INTERNAL.search(msg.replace(option, "")), msg


def test_options_that_trl_leaves_unused_are_not_checked():
    """TRL reads ``delta`` for the ppo family only and the sapo temperatures for sapo only."""
    for loss_type in ("cispo", "sapo"):
        _loss(loss_type=loss_type, delta=0.5)
    _loss(loss_type="dapo", sapo_temperature_pos=INF)


# --------------------------------------------------------------------------- top_entropy_quantile
def _trls_entropy_mask(entropies, mask, quantile):
    """TRL's own ``GRPOTrainer.get_high_entropy_mask`` on one process."""
    trl = pytest.importorskip("trl")
    one_process = SimpleNamespace(
        accelerator=SimpleNamespace(pad_across_processes=lambda x, **_: x, gather=lambda x: x)
    )
    return trl.GRPOTrainer.get_high_entropy_mask(one_process, entropies, mask, 1 - quantile)


@pytest.mark.parametrize("ties", [False, True])
def test_top_entropy_quantile_zero_keeps_the_highest_entropy_token(ties):
    """TRL's GRPOConfig: "Range: [0.0-1.0]. A value of 0.0 masks all but the highest entropy
    token" (tokens tied with it too: ``torch.quantile(H, 1.0)`` is the max, kept by ``>=``).
    The normaliser still counts every completion token (TRL multiplies the per-token loss by
    the mask; bnpo divides by ``mask.sum()``)."""
    entropies = torch.tensor([[0.3, 1.7, 0.2, 0.9], [1.1, 0.4, 5.0, 0.6]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    entropies[1, 3] = 2.0  # padded in no row: a larger entropy at a masked position is
    entropies[0, 3] = 9.0  # ignored (row 0's last token is padding)
    if ties:
        entropies[0, 1] = 5.0
    top = {(1, 2), (0, 1)} if ties else {(1, 2)}
    adv = torch.tensor([2.0, -3.0])
    logp = torch.log(torch.rand(2, 4)).requires_grad_()
    loss, _ = rtrl.grpo_loss(
        logp, None, adv, mask, loss_type="bnpo", entropies=entropies, top_entropy_quantile=0.0
    )
    n = int(mask.sum())
    want = sum(-float(adv[i]) for i, _ in top) / n  # on policy: each kept token's loss is −A
    assert loss.item() == pytest.approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    want_grad = torch.zeros(2, 4)
    for i, j in top:
        want_grad[i, j] = -adv[i] / n
    torch.testing.assert_close(grad, want_grad)


def test_top_entropy_quantile_zero_is_trls_mask():
    """The kept tokens are those of TRL's own mask at quantile 0 (and 0.3), on random
    entropies; float32 ones, as TRL takes the quantile of ``entropies.float()``."""
    g = torch.Generator().manual_seed(0)
    entropies = torch.rand(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) < 0.7).long()
    adv = torch.randn(5, generator=g, dtype=torch.float64)
    for quantile in (0.0, 0.3):
        keep = _trls_entropy_mask(entropies, mask, quantile)
        logp = torch.zeros(5, 7, dtype=torch.float64, requires_grad=True)
        loss, _ = rtrl.grpo_loss(
            logp,
            None,
            adv,
            mask,
            loss_type="bnpo",
            entropies=entropies,
            top_entropy_quantile=quantile,
        )
        (grad,) = torch.autograd.grad(loss, logp)
        # on policy the gradient of token (i, t) is −A_i / N where kept, else 0
        want = torch.where(keep, -adv[:, None] / mask.sum(), 0.0)
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- float64 advantages
def _eps64(values):
    """A few float64 ulps of the largest value: the error of a handful of roundings."""
    return 8 * torch.finfo(torch.float64).eps * max(abs(v) for v in values)


def test_float64_advantages_have_float64_accuracy():
    """``(r − mean) / (stdev + 1e-4)`` with ``statistics.stdev`` (Bessel) as the definition."""
    r = [1.0, 0.0, 0.5, 0.25]
    mean, sd = statistics.mean(r), statistics.stdev(r)
    want = [(x - mean) / (sd + 1e-4) for x in r]
    got = rtrl.grpo_advantages(torch.tensor(r, dtype=torch.float64), 4)
    assert got.dtype == torch.float64
    assert max(abs(a - b) for a, b in zip(got.tolist(), want, strict=True)) <= _eps64(want)


def test_float64_advantages_batch_scaling_and_nan_rewards():
    """Two groups of 4, one unscorable completion: its reward leaves the group's mean and the
    batch's stdev (over 7 rewards: Bessel's 7/6 is inexact in float32), and its advantage is 0
    (TRL's ``nanmean``/``nanstd``, ``nan_to_num``)."""
    r = [0.7, NAN, 0.1, 0.3, 2.0, 1.3, 0.4, 0.9]
    scored = [x for x in r if not math.isnan(x)]
    sd = statistics.stdev(scored)
    means = [statistics.mean([0.7, 0.1, 0.3])] * 4 + [statistics.mean([2.0, 1.3, 0.4, 0.9])] * 4
    want = [0.0 if math.isnan(x) else (x - m) / (sd + 1e-4) for x, m in zip(r, means, strict=True)]
    got = rtrl.grpo_advantages(torch.tensor(r, dtype=torch.float64), 4, scale_rewards="batch")
    assert got.dtype == torch.float64
    assert max(abs(a - b) for a, b in zip(got.tolist(), want, strict=True)) <= _eps64(want)


def test_float64_advantages_normalize_then_sum():
    r = [[1.0, 0.2], [0.0, 0.9], [0.5, 0.3], [0.25, 0.6]]
    w = [1.0, 0.5]
    cols = list(zip(*r, strict=True))
    per_func = [[(x - statistics.mean(c)) / (statistics.stdev(c) + 1e-4) for x in c] for c in cols]
    summed = [sum(wk * per_func[k][i] for k, wk in enumerate(w)) for i in range(4)]
    want = [(s - statistics.mean(summed)) / (statistics.stdev(summed) + 1e-4) for s in summed]
    got = rtrl.grpo_advantages(
        torch.tensor(r, dtype=torch.float64),
        4,
        reward_weights=w,
        multi_objective_aggregation="normalize_then_sum",
    )
    assert got.dtype == torch.float64
    assert max(abs(a - b) for a, b in zip(got.tolist(), want, strict=True)) <= _eps64(want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_advantages_are_in_the_rewards_dtype(dtype):
    r = torch.tensor([[1.0, 0.5], [0.0, NAN], [0.5, 0.25], [0.25, 1.0]], dtype=dtype)
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        for scale in ("group", "batch", "none"):
            got = rtrl.grpo_advantages(
                r,
                2,
                reward_weights=[1.0, 2.0],
                scale_rewards=scale,
                multi_objective_aggregation=aggregation,
            )
            assert got.dtype == dtype


# --------------------------------------------------------------------------- reward_weights
@pytest.mark.parametrize(
    "weights", [[1.0, NAN], [NAN, NAN], [1.0, INF], [-INF, 1.0], torch.tensor([1.0, NAN])]
)
def test_non_finite_reward_weights_raise(weights):
    """TRL 1.16 does not check ``reward_weights`` and its ``nansum`` turns a NaN weight into 0;
    a NaN weight is a configuration error, not an unscored reward: it raises, naming it."""
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [1.0, 1.0]])
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        with pytest.raises(ValueError, match=r"reward_weights must be 2 finite .*(nan|inf)"):
            rtrl.grpo_advantages(
                r, 2, reward_weights=weights, multi_objective_aggregation=aggregation
            )


def test_nan_rewards_are_still_unscored():
    """A NaN *reward* is TRL's unscored completion (skipped by ``nansum``); only a NaN weight
    raises. Row 1's second function is unscored: its total is its first reward alone."""
    r = torch.tensor([[1.0, 2.0], [3.0, NAN]])
    got = rtrl.grpo_advantages(r, 2, reward_weights=[1.0, 0.5], scale_rewards="none")
    totals = [1.0 + 0.5 * 2.0, 3.0]
    mean = statistics.mean(totals)
    torch.testing.assert_close(got, torch.tensor([t - mean for t in totals]))


# --------------------------------------------------------------------------- GRPOMixin's bases
def test_mixin_without_trls_trainer_raises_a_type_error_saying_what_it_needs():
    class NotATrainer(rtrl.GRPOMixin):  # a class between is fine: only instances are checked
        pass

    for cls in (NotATrainer, rtrl.GRPOMixin):
        with pytest.raises(
            TypeError,
            match=r"GRPOMixin must come before trl\.GRPOTrainer in the "
            r"bases: class \w+\(GRPOMixin, trl\.GRPOTrainer\)",
        ):
            cls()


def test_mixin_after_trls_trainer_raises_at_class_creation():
    trl = pytest.importorskip("trl")

    with pytest.raises(
        TypeError,
        match=r"class Wrong\(GRPOMixin, trl\.GRPOTrainer\).*"
        r"puts trl\.GRPOTrainer first",
    ):

        class Wrong(trl.GRPOTrainer, rtrl.GRPOMixin):
            pass

    class Between(rtrl.GRPOMixin):
        pass

    class Right(Between, trl.GRPOTrainer):  # the mixin (through Between) before TRL's trainer
        pass

    assert Right.__mro__.index(rtrl.GRPOMixin) < Right.__mro__.index(trl.GRPOTrainer)


WITHOUT_TRL = """
import sys
for name in ("trl", "transformers", "accelerate", "datasets"):
    sys.modules[name] = None  # an import of any of them now raises ImportError
from rlops.compat.trl import GRPOMixin
class Between(GRPOMixin):
    pass
try:
    Between()
except TypeError as exc:
    print(exc)
"""


def test_the_bases_check_imports_no_trl():
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRL], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "GRPOMixin must come before trl.GRPOTrainer in the bases" in out.stdout


# --------------------------------------------------------------------------- the mixin's options
def _trainer(tmp_path, **options):
    """A TRL trainer with the mixin: tiny Llama, word-level tokenizer, 8 prompts."""
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")

    words = "the cat sat on a mat and dog ran far away up down one two".split()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(words)],
        tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]),
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
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
        )
    )

    class Trainer(rtrl.GRPOMixin, trl.GRPOTrainer):
        pass

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
    check = options.pop("check", False)
    args.update(options)
    n = len(args.get("reward_weights") or [1])
    return Trainer(
        model=model,
        reward_funcs=[lambda completions, **_: [len(c) / 10 for c in completions]] * n,
        args=trl.GRPOConfig(**args),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["the cat sat", "a dog ran"] * 4}),
        processing_class=tokenizer,
        check=check,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"reward_weights": [1.0, NAN]}, r"reward_weights must be 2 finite .*nan"),
        ({"temperature": 0.0}, r"temperature must be > 0, got 0.0"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\].*got 1.5"),
        ({"loss_type": "sapo", "sapo_temperature_neg": -1.0}, r"sapo_temperature_neg must be"),
        ({"epsilon": 0.0}, r"epsilon must be > 0, got 0.0"),
    ],
)
def test_mixin_checks_trls_options_at_construction(tmp_path, options, match):
    """TRL's GRPOConfig accepts these; the mixin raises when the trainer is built."""
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, **options)


@pytest.mark.slow
def test_mixin_trains_with_top_entropy_quantile_zero_as_trl(tmp_path):
    """``check=True`` compares the first loss and every gradient with TRL's own
    ``_compute_loss`` at ``top_entropy_quantile=0.0`` (TRL's documented bound)."""
    trainer = _trainer(tmp_path, top_entropy_quantile=0.0, loss_type="bnpo", check=True)
    trainer.train()
    assert trainer._rlops_loss_checked
