"""Drop-in adapters for the call sites of other RL trainers, on rlops; imported explicitly::

    from rlops.compat import sglang, slime, trl, verl, vllm

Each keeps the original's names, arguments and return values, checks its arguments under the
original's names and makes one or two rlops calls; docs/integration.md shows each swap.
"""
