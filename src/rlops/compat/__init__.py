"""Drop-in adapters for the call sites of other RL trainers, implemented on rlops.

Three submodules, imported explicitly (nothing is re-exported here)::

    from rlops.compat import slime, trl, verl

* :mod:`rlops.compat.slime` — the functions of slime's ``slime/utils/ppo_utils.py``, its
  context-parallel helpers and its critic loss (``value_loss_function``), with slime's
  per-sample lists of 1-D tensors. Where slime reads
  Megatron's global parallel state, the adapters take the process group as a keyword argument
  (``cp_group=``, ``tp_group``, ``process_group=``).
* :mod:`rlops.compat.trl` — TRL's GRPO: ``grpo_advantages`` and ``grpo_loss`` with TRL's
  option names and semantics, and ``GRPOMixin``, which makes ``trl.GRPOTrainer`` compute its
  log-probs, advantages and loss with rlops (TRL imported only when the mixin is used).
* :mod:`rlops.compat.verl` — the functions of verl's ``verl/trainer/ppo/core_algos.py`` and
  ``verl/utils/torch_functional.py``, on ``[bs, response_length]`` tensors.

Each adapter keeps the original's name, arguments and return tuple, checks its arguments under
the original's names, pads ragged inputs into one ``[B, T_max]`` batch with a mask, makes one
rlops call and splits the result back. Where the
original computes something wrong (a REINFORCE++ return that resets at tool-output tokens,
whitening that turns NaN on constant advantages, context-parallel bookkeeping that breaks when a
rank holds no response token), the adapter keeps rlops' semantics and its docstring says how
the two differ. ``docs/integration.md`` shows the swap for each call site.
"""
