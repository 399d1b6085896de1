"""The measurement harness behind ``rlops bench | profile`` and the scripts in ``benchmarks/``:
what rlops is measured against, on which workloads, and how.

Its public surface is seven modules, each with an explicit ``__all__``:

* :mod:`~rlops.measure.baselines`: the implementations rlops replaces (per-token and chunk
  loops, per-sample group loops, ``log_softmax``), each tested against rlops' values;
* :mod:`~rlops.measure.workloads`: steps built in a fresh process (log-probs over logits, the
  output layer, a top-p keep mask);
* :mod:`~rlops.measure.timing`: median wall time, of the methods compared timed interleaved,
  at one or several torch thread counts (set for a block and put back after), and peak
  memory, in this process or a fresh one;
* :mod:`~rlops.measure.sections`: the rows of ``rlops bench`` (advantages, group, logprobs,
  agentic, distillation);
* :mod:`~rlops.measure.plot`: the figure of a bench run;
* :mod:`~rlops.measure.ppo`: the PPO step ``rlops profile`` runs stage by stage;
* :mod:`~rlops.measure.options`: argument types and checks of the commands that measure.

It drives the public API only; the command line (``rlops.cli``) builds on it.
"""

from rlops.measure import baselines, options, plot, ppo, sections, timing, workloads

__all__ = ["baselines", "options", "plot", "ppo", "sections", "timing", "workloads"]
