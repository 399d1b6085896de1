"""``GRPOMixin``: TRL's ``GRPOTrainer`` on rlops; TRL is never imported at module level."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import torch

import rlops
from rlops._checks import check_bool, check_finite_positive, check_logit_scale, check_softcap
from rlops._types import Group
from rlops.compat.trl._advantages import check_reward_weights, grpo_advantages
from rlops.compat.trl._head import RlopsChunkedLogProb, head_options, patch
from rlops.compat.trl._loss import (
    LOSS_TYPES,
    LossOptions,
    checked_batch,
    loss_and_stats,
    one_pass_call,
    one_pass_eligible,
)
from rlops.kl_controllers import AdaptiveEntropyController

SUPPORTED_TRL = ">=1.16,<1.17"
"""The TRL versions :class:`GRPOMixin` is tested against (the ``trl`` extra pins them)."""


def _unsupported(option: str, value: object, why: str) -> ValueError:
    """The error for a TRL option the mixin does not serve, naming it."""
    return ValueError(f"rlops.compat.trl.GRPOMixin does not support {option}={value!r}: {why}")


def _is_trl_grpo_trainer(cls: type) -> bool:
    """Whether ``cls`` is TRL's ``GRPOTrainer``, by name and package (TRL not imported)."""
    return cls.__name__ == "GRPOTrainer" and cls.__module__.split(".")[0] == "trl"


def _bases_error(cls: type, why: str) -> TypeError:
    """What :class:`GRPOMixin` needs of the class it is mixed into, and what ``cls`` has."""
    name = "Trainer" if cls is GRPOMixin else cls.__name__
    bases = ", ".join(b.__name__ for b in cls.__bases__)
    return TypeError(
        f"GRPOMixin must come before trl.GRPOTrainer in the bases: class {name}(GRPOMixin, "
        f"trl.GRPOTrainer); {why} (class {cls.__name__}({bases}))"
    )


class GRPOMixin:
    """TRL's GRPO trainer with rlops's log-probs, advantages and loss: put it first.

    ``class Trainer(GRPOMixin, trl.GRPOTrainer)`` trains as TRL's trainer with the log-probs
    from the hidden states (:func:`rlops.linear_logprobs_and_entropy`), :func:`grpo_advantages`
    and :func:`grpo_loss`; ``check=True`` compares its first step with TRL's
    (docs/integration-trl.md). Where TRL's loss allows it, the loss comes from
    :func:`rlops.linear_policy_loss` in one pass over the vocabulary (``one_pass=False``: never).

    Example (not run here: it needs TRL, a model and a dataset)::

        import trl
        from rlops.compat.trl import GRPOMixin

        class Trainer(GRPOMixin, trl.GRPOTrainer):
            pass

        trainer = Trainer(model=model, reward_funcs=reward, args=trl.GRPOConfig(...),
                          train_dataset=dataset, check=True)
        trainer.train()
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        trainer = next((i for i, c in enumerate(mro) if _is_trl_grpo_trainer(c)), None)
        if trainer is not None and trainer < mro.index(GRPOMixin):
            raise _bases_error(
                cls, f"{cls.__name__} puts trl.GRPOTrainer first, whose methods hide the mixin's"
            )

    def __init__(
        self, *args: Any, check: bool = False, one_pass: bool = True, **kwargs: Any
    ) -> None:
        # checked here, not at class creation: a class between (class M(GRPOMixin)) is fine
        if not any(_is_trl_grpo_trainer(c) for c in type(self).__mro__):
            name = type(self).__name__
            raise _bases_error(type(self), f"{name} does not derive from trl.GRPOTrainer")
        self._rlops_check = check_bool("check", check)
        self._rlops_one_pass = check_bool("one_pass", one_pass)
        self._rlops_loss_checked = self._rlops_adv_checked = False
        self._rlops_use_trl = False
        self._rlops_rewards: torch.Tensor | None = None
        super().__init__(*args, **kwargs)
        self._rlops_check_options()

    # ----------------------------------------------------------------------------- options
    def _rlops_check_options(self) -> None:
        import trl
        from packaging.version import Version

        version = Version(trl.__version__)
        if not Version("1.16") <= version < Version("1.17"):
            raise ImportError(
                f"rlops.compat.trl supports TRL {SUPPORTED_TRL}, found {trl.__version__}"
            )
        t: Any = self
        args = t.args
        if t.loss_type not in LOSS_TYPES:
            raise _unsupported("loss_type", t.loss_type, f"the loss types served are {LOSS_TYPES}")
        if t.use_adaptive_entropy:
            self._rlops_entropy_controller()  # TRL's settings checked, named as TRL names them
        if t.off_policy_mask_threshold is not None:
            raise _unsupported(
                "off_policy_mask_threshold",
                t.off_policy_mask_threshold,
                "off-policy sequence masking is not wired through",
            )
        if t.use_vllm and t.vllm_importance_sampling_correction:
            raise _unsupported(
                "vllm_importance_sampling_correction", True, "set it to False, or use TRL's trainer"
            )
        if t.aux_loss_enabled:
            raise _unsupported(
                "router_aux_loss_coef",
                t.router_aux_loss_coef,
                "the MoE router loss is not computed from the hidden states",
            )
        if getattr(t, "_is_vlm", False):
            raise _unsupported(
                "model", type(t.model).__name__, "vision-language models are not supported"
            )
        head, scale_name = head_options(t.model.config.get_text_config())
        try:
            check_logit_scale(head["logit_scale"])
        except (TypeError, ValueError) as exc:
            value = head["logit_scale"]
            raise _unsupported(f"model.config.{scale_name}", value, str(exc)) from None
        try:
            check_softcap(head["final_logit_softcapping"])
        except (TypeError, ValueError) as exc:
            value = head["final_logit_softcapping"]
            raise _unsupported("model.config.final_logit_softcapping", value, str(exc)) from None
        if args.delta is not None and t.loss_type in ("bnpo", "dapo", "dr_grpo", "grpo", "luspo"):
            if args.delta < 1 + t.epsilon_high:
                raise _unsupported(
                    "delta", args.delta, f"delta must be >= 1 + epsilon_high = {1 + t.epsilon_high}"
                )
        # TRL's config checks none of these: a bad value raises now, naming TRL's option
        check_finite_positive("temperature", t.temperature)
        check_reward_weights(t.reward_weights, len(t.reward_funcs))
        self._rlops_loss_options()

    def _rlops_loss_options(self, **per_step: Any) -> LossOptions:
        """TRL's loss options of this trainer, with this step's ``per_step`` ones."""
        t: Any = self
        args = t.args
        config = {
            "loss_type": t.loss_type,
            "epsilon": t.epsilon_low,
            "epsilon_high": t.epsilon_high,
            "delta": args.delta,
            "importance_sampling_level": t.importance_sampling_level,
            "beta": t.beta,
            "use_bias_correction_kl": args.use_bias_correction_kl,
            "top_entropy_quantile": t.top_entropy_quantile,
            "entropy_coef": t.entropy_coef,
            "sapo_temperature_pos": args.sapo_temperature_pos,
            "sapo_temperature_neg": args.sapo_temperature_neg,
            "max_completion_length": t.max_completion_length,
            "num_processes": t.accelerator.num_processes,
            "steps_per_generation": args.steps_per_generation,
        }
        return LossOptions(**{**config, **per_step})

    def _rlops_entropy_controller(self) -> AdaptiveEntropyController:
        """TRL's adaptive entropy state (``entropy_coef``, ``_last_world_entropy``: what its
        checkpoints save) as a controller."""
        t: Any = self
        args = t.args
        ctrl = AdaptiveEntropyController(
            entropy_coef=t.entropy_coef,
            entropy_target=args.entropy_target,
            entropy_coef_delta=args.entropy_coef_delta,
            entropy_coef_min=args.entropy_coef_min,
            entropy_coef_max=args.entropy_coef_max,
        )
        ctrl.entropy = t._last_world_entropy
        return ctrl

    def _rlops_entropy_state(self, state: tuple | None = None) -> tuple:
        """TRL's adaptive entropy state, set to ``state`` when given; the state before."""
        t: Any = self
        before = (t.entropy_coef, t._last_world_entropy, t._entropy_window_stats)
        if state is not None:
            t.entropy_coef, t._last_world_entropy, t._entropy_window_stats = state
        return before

    def _rlops_adapt_entropy(self, ctrl: AdaptiveEntropyController, bonus: torch.Tensor) -> None:
        """TRL's adaptive update: the micro-batch's ``[entropy sum, count]`` into the window;
        at the optimizer step's end the mean over every process updates the coefficient."""
        t: Any = self
        window = t._entropy_window_stats
        t._entropy_window_stats = bonus if window is None else window + bonus
        if not t.accelerator.sync_gradients:
            return
        stats = t.accelerator.reduce(t._entropy_window_stats, reduction="sum")
        entropy = (stats[0] / stats[1].clamp(min=1.0)).item()
        if math.isnan(entropy):  # TRL's comparison: above the target (the controller raises)
            low, delta = ctrl.entropy_coef_min, ctrl.entropy_coef_delta
            ctrl.entropy_coef = max(float(ctrl.entropy_coef) - delta, low)
        else:
            ctrl.update(entropy)
        t.entropy_coef, t._last_world_entropy = ctrl.entropy_coef, entropy
        t._entropy_window_stats = None

    @contextmanager
    def _rlops_as_trl(self):
        """TRL's own log-probs inside the block (for the check), on TRL's own head."""
        from trl.trainer import utils

        patched = utils._ChunkedLogProbFunction is RlopsChunkedLogProb
        self._rlops_use_trl = True
        if patched:
            patch(False)
        try:
            yield
        finally:
            self._rlops_use_trl = False
            if patched:
                patch(True)

    # ----------------------------------------------------------------------------- log-probs
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if self._rlops_use_trl:
            return super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        given = [k for k, v in multimodal.items() if v is not None]
        if given:
            raise _unsupported(given[0], "...", "multimodal inputs are not supported")
        t: Any = self
        weight, bias, lp_options = _head(t, model)
        entropy_grad = bool(t._entropy_bonus_enabled) and torch.is_grad_enabled()
        logps, entropies = [], []
        for hidden, target, valid in _hidden(
            t, model, input_ids, attention_mask, logits_to_keep, batch_size, weight.dtype
        ):
            lp, ent = rlops.linear_logprobs_and_entropy(
                hidden,
                weight,
                target,
                bias=bias,
                temperature=t.temperature,
                with_entropy=compute_entropy,
                entropy_grad=entropy_grad,
                mask=valid,  # padding after a completion's end costs nothing
                **lp_options,
            )
            logps.append(lp)
            if compute_entropy:
                assert ent is not None
                entropies.append(ent)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None)

    # ----------------------------------------------------------------------------- advantages
    def _calculate_rewards(self, *args, **kwargs):
        rewards = super()._calculate_rewards(*args, **kwargs)  # type: ignore[misc]
        self._rlops_rewards = rewards
        return rewards

    def _generate_and_score_completions(self, generation_batch):
        out = super()._generate_and_score_completions(generation_batch)  # type: ignore[misc]
        t: Any = self
        rewards = self._rlops_rewards
        assert rewards is not None
        mode = "train" if t.model.training else "eval"
        g = t.num_generations if mode == "train" else t.num_generations_eval
        adv = grpo_advantages(
            rewards,
            g,
            reward_weights=t.reward_weights.to(rewards.device),
            scale_rewards=t.scale_rewards,
            multi_objective_aggregation=t.multi_objective_aggregation,
        )
        n = out["advantages"].shape[0]
        start = t.accelerator.process_index * n
        adv = adv[start : start + n].to(out["advantages"].dtype)
        if self._rlops_check and not self._rlops_adv_checked:
            self._rlops_adv_checked = True
            _compare("advantages", adv, out["advantages"], _tolerance(adv.dtype, None))
        out["advantages"] = adv
        return out

    # ----------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        if self._rlops_check and not self._rlops_loss_checked:
            self._rlops_loss_checked = True
            return self._rlops_checked_loss(model, inputs)
        return self._rlops_loss(model, inputs)

    def _rlops_checked_loss(self, model, inputs):
        """The loss, checked against TRL's own on the same batch (``check=True``, once)."""
        t: Any = self
        mode = "train" if t.model.training else "eval"
        logged = {k: len(v) for k, v in t._metrics[mode].items()}
        params = [p for p in model.parameters() if p.requires_grad]
        grads = t.accelerator.num_processes == 1 and torch.is_grad_enabled()
        state = self._rlops_entropy_state()
        with self._rlops_as_trl():
            ref = super()._compute_loss(model, inputs)  # type: ignore[misc]
        trl_coef = self._rlops_entropy_state(state)[0]  # TRL's update undone: ours runs it
        ref_grads = torch.autograd.grad(ref, params, allow_unused=True) if grads else ()
        ref = ref.detach()
        for key in list(t._metrics[mode]):  # keep TRL's metrics of this step out of the logs
            del t._metrics[mode][key][logged.get(key, 0) :]
        loss = self._rlops_loss(model, inputs)
        tol = _tolerance(params[0].dtype if params else torch.float32, t.args)
        _compare("loss", loss.detach(), ref, tol)
        coef = torch.tensor(float(t.entropy_coef))
        _compare("entropy coefficient", coef, torch.tensor(float(trl_coef)), tol)
        if grads:
            ours = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            pairs = [(a, b) for a, b in zip(ours, ref_grads, strict=True) if b is not None]
            _compare(
                "gradient",
                torch.cat([a.reshape(-1) for a, _ in pairs]),
                torch.cat([b.reshape(-1) for _, b in pairs]),
                tol,
            )
        return loss

    def _rlops_loss(self, model, inputs):
        t: Any = self
        completion_ids = inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = (
            completion_mask
            if "tool_mask" not in inputs
            else (completion_mask * inputs["tool_mask"])
        )
        mode = "train" if t.model.training else "eval"
        ctrl = self._rlops_entropy_controller() if t.use_adaptive_entropy else None
        # the coefficient (and, adaptive, its gating) of the last optimizer step's end
        coef = t.entropy_coef if ctrl is None else ctrl.value
        options = self._rlops_loss_options(
            entropy_coef=coef if t._entropy_bonus_enabled else 0.0,
            gradient_accumulation_steps=t.current_gradient_accumulation_steps,
            training=mode == "train",
        )
        old = inputs.get("old_per_token_logps")
        # without gradients (evaluation) the one pass's gradients would be made for nothing
        one_pass = self._rlops_one_pass and torch.is_grad_enabled()
        if one_pass and one_pass_eligible(options):
            loss, logps, entropies = self._rlops_one_pass_loss(
                model, input_ids, attention_mask, mask, inputs, options
            )
        else:
            one_pass = False
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
            )
        x = checked_batch(logps, old, inputs["advantages"], mask)
        composed, policy, sums, per_row, bonus = loss_and_stats(
            x,
            options,
            inputs.get("ref_per_token_logps"),
            entropies,
            inputs.get("num_items_in_batch"),
            _group(t.accelerator),
        )
        if not one_pass:  # TRL's loss of the log-probs (one pass: of its detached ones)
            loss = composed
        if ctrl is not None and mode == "train":  # evaluation leaves the controller as it is
            assert bonus is not None
            self._rlops_adapt_entropy(ctrl, bonus)
        self._rlops_log(mode, policy, sums, per_row)
        return loss

    def _rlops_one_pass_loss(self, model, input_ids, attention_mask, mask, inputs, options):
        """TRL's loss by :func:`rlops.linear_policy_loss` in one pass, and the detached
        log-probs and entropies ``[B, T]`` its metrics are made of."""
        t: Any = self
        weight, bias, lp_options = _head(t, model)
        k = inputs["completion_ids"].size(1)
        # one forward over the batch (TRL's loss takes it whole), then one call over [B, k, H]
        ((hidden, target, _),) = _hidden(t, model, input_ids, attention_mask, k, None, weight.dtype)
        dtype = torch.promote_types(weight.dtype, torch.float32)  # the log-probs' dtype
        probe = torch.zeros(target.shape, dtype=dtype, device=hidden.device)
        x = checked_batch(probe, None, inputs["advantages"], mask)
        call = one_pass_call(options, x.keep, inputs.get("num_items_in_batch"), x.logps)
        loss, metrics = rlops.linear_policy_loss(
            hidden,
            weight,
            target,
            inputs.get("old_per_token_logps"),
            x.adv,
            x.keep,
            bias=bias,
            temperature=t.temperature,
            logprob_options=lp_options,
            one_pass=True,
            return_logprobs=True,
            **call.kwargs,
        )
        if call.divisor != 1:
            loss = loss / call.divisor
        return loss, metrics["logp"], metrics["entropy"]

    def _rlops_log(
        self,
        mode: str,
        policy: torch.Tensor,
        sums: dict[str, tuple[torch.Tensor, torch.Tensor]],
        per_row: dict[str, torch.Tensor],
    ) -> None:
        """TRL's metrics, reduced over the processes as TRL does."""
        t: Any = self
        acc = t.accelerator
        metrics = t._metrics[mode]
        names = list(sums)
        if t._entropy_bonus_enabled:
            metrics["policy_loss"].append(acc.gather(policy).nanmean().item())
            if mode == "train" and acc.sync_gradients:
                metrics["entropy_coef"].append(t.entropy_coef)
        if names:
            vec = torch.stack([torch.stack([s.float(), n.float()]) for s, n in sums.values()])
            vec = acc.reduce(vec, reduction="sum")
            values = (vec[:, 0] / vec[:, 1].clamp(min=1.0)).tolist()
            for name, value in zip(names, values, strict=True):
                metrics[name].append(value)
        for name, x in per_row.items():
            gathered = acc.gather(x)
            finite = gathered[~torch.isnan(gathered)]
            value = (
                math.nan
                if finite.numel() == 0
                else (finite.min() if name.endswith("_min") else finite.max()).item()
            )
            metrics[name].append(value)


def _head(t: Any, model) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """The output layer's weight and bias, and the log-prob op's options TRL's head has."""
    unwrapped = t.accelerator.unwrap_model(model)
    head = unwrapped.get_output_embeddings()
    # the head's scale and softcap, as TRL's fused head reads them (checked at construction)
    scaled, _ = head_options(unwrapped.config.get_text_config())
    # TRL's float32 head: float32 logits from the weight as it is, never a float32 copy
    wide = torch.float32 if t.args.cast_lm_head_to_fp32 else None
    return head.weight, head.bias, {**scaled, "logits_dtype": wide}


def _hidden(t: Any, model, input_ids, attention_mask, k, batch_size, dtype):
    """Per TRL micro-batch of trainer ``t``: the last hidden states ``[b, k, H]`` in ``dtype``
    that predict the last ``k`` tokens, those tokens ``[b, k]`` and their attention mask."""
    batch_size = batch_size or input_ids.size(0)
    for start in range(0, input_ids.size(0), batch_size):  # TRL's micro-batches
        ids = input_ids[start : start + batch_size]
        am = attention_mask[start : start + batch_size]
        with t.accelerator.autocast():
            out = model(
                input_ids=ids,
                attention_mask=am,
                output_hidden_states=True,
                logits_to_keep=1,
                use_cache=False,
            )
        # the hidden state at position p predicts token p + 1
        yield out.hidden_states[-1][:, -k - 1 : -1].to(dtype), ids[:, -k:], am[:, -k:].bool()


def _group(accelerator: Any) -> Group:
    """The process group of the data-parallel processes, None for one process."""
    if accelerator.num_processes == 1:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


def _tolerance(dtype: torch.dtype, args: Any) -> float:
    """``256·eps`` of ``dtype``, or ``2·eps`` of the autocast half dtype if larger."""
    tol = 256 * torch.finfo(dtype).eps
    for flag, half in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if args is not None and getattr(args, flag, False):
            tol = max(tol, 2 * torch.finfo(half).eps)
    return tol


def _compare(what: str, ours: torch.Tensor, trl_value: torch.Tensor, tol: float) -> None:
    """Raise when ``ours`` differs from TRL's by more than ``tol`` relative to TRL's largest."""
    ours, trl_value = ours.double(), trl_value.double().to(ours.device)
    scale = max(float(trl_value.abs().max()) if trl_value.numel() else 0.0, 1e-30)
    diff = float((ours - trl_value).abs().max()) if ours.numel() else 0.0
    if not diff <= tol * scale:
        raise RuntimeError(
            f"rlops.compat.trl.GRPOMixin(check=True): the {what} differs from TRL's by "
            f"{diff:.3g} (TRL's largest {scale:.3g}; tolerance {tol:.3g} relative)"
        )
