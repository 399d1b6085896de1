"""TRL's GRPO on rlops: its advantages and loss with TRL's names, and a trainer mixin.

Names, arguments and semantics follow TRL 1.16's ``trl/trainer/grpo_trainer.py``
(``GRPOTrainer._generate_and_score_completions`` for the advantages, ``_compute_loss`` for the
loss, ``_get_per_token_logps_and_entropies`` for the log-probs) and ``GRPOConfig``'s options.
Supported and tested: TRL 1.16.x (:data:`SUPPORTED_TRL`). TRL is imported only when
:class:`GRPOMixin` is used; the two functions need torch alone. Arguments are checked first
and errors name TRL's options, their range and the value given (TRL's ``GRPOConfig`` checks
none of these numbers; :class:`GRPOMixin` checks them when the trainer is built). Where TRL
is silent on a value: a NaN or infinite ``reward_weights`` entry raises (TRL's ``nansum``
takes a NaN weight as 0: the function is dropped without a word); ``top_entropy_quantile=0``
is served as TRL documents it (the highest-entropy token, and any tied with it).

* :func:`grpo_advantages` — TRL's advantages ``[B]`` from the rewards of every reward function:
  group or batch scaling, ``eps = 1e-4``, unscorable (NaN) rewards left out of the group
  statistics and given advantage 0, both ``multi_objective_aggregation`` modes.
* :func:`grpo_loss` — TRL's loss for one micro-batch, for every ``loss_type`` but ``"vespo"``,
  as one :func:`rlops.policy_loss` per-token matrix, TRL's KL term, one
  :func:`rlops.aggregate_loss` with TRL's normaliser, and TRL's entropy bonus.
* :class:`GRPOMixin` — ``class Trainer(GRPOMixin, trl.GRPOTrainer)`` is TRL's trainer with
  rlops computing the log-probs and entropies from the final hidden states (the ``[B, T, V]``
  logits never exist; only the completion tokens are scored), the advantages and the loss,
  logging TRL's metrics under TRL's names.
* :func:`patch` — TRL's fused LM head (``add_fused_lm_head``, used by all of TRL's trainers)
  served by :func:`rlops.linear_logprobs_and_entropy`.

How TRL's options map (``ε_l = epsilon``, ``ε_h = epsilon_high``, default ``epsilon``)::

    loss_type  policy_loss kind                aggregation (TRL's normaliser)
    grpo       ppo (gspo at sequence level)    seq-mean-token-mean, num_seqs = B, / GA
    bnpo       ppo (gspo)                      token-mean over this call's tokens, / GA
    dr_grpo    ppo (gspo)                      seq-mean-token-sum-norm, num_seqs = B,
                                               loss_scale_factor = max_completion_length, / GA
    dapo       ppo (gspo)                      token-mean, num_tokens = num_items_in_batch /
                                               num_processes · GA / steps_per_generation
    luspo      ppo (gspo)                      seq-mean-token-sum, num_seqs = B, / GA
    cispo      cispo, clip_low = inf,          as dapo
               clip_high = ε_h − 1 (TRL's ε_h is an absolute cap on the ratio; a cap ≤ 1,
               e.g. TRL's default 0.2, is reinforce with the weight sg(min(r, ε_h)))
    sapo       sapo (tau_pos, tau_neg =        as grpo
               sapo_temperature_pos/neg)

``clip_low = ε_l``, ``clip_high = ε_h``; TRL's ``delta`` (the upper bound of the two-sided
clip) is rlops's ``dual_clip`` (equal where ``delta ≥ 1 + ε_h``, as TRL recommends; smaller is
rejected); ``importance_sampling_level="sequence"`` is kind ``gspo`` for the ppo family and
``level="sequence"`` for cispo and sapo. The top-entropy mask (``top_entropy_quantile``) enters
as ``rollout_is_weights``, not as the mask, so that the normaliser still counts every
completion token (as TRL). ``num_seqs = B`` makes a row without completion tokens (a truncated
completion under ``mask_truncated_completions``) count in the sequence means, as TRL divides by
every row; rlops's own default leaves such rows out. ``GA`` is
``gradient_accumulation_steps`` (1 in evaluation).
"""

from rlops.compat._trl_loss import LOSS_TYPES, SUPPORTED_TRL, grpo_advantages, grpo_loss
from rlops.compat._trl_mixin import GRPOMixin, patch

__all__ = ["LOSS_TYPES", "SUPPORTED_TRL", "GRPOMixin", "grpo_advantages", "grpo_loss", "patch"]
