"""The three numerics contracts tested as contracts: every correct implementation of the corpus
(``corpus_logprobs``, ``corpus_losses``, ``corpus_advantages``) passes every check, and every
broken one fails the check it names. Zero false positives, zero misses, counted.

The fast tier runs each correct implementation at seed 0 (log-probs at τ = 1 and 0.7, small
vocabularies) and each broken one at seed 0. The sweep (``slow``) runs the correct ones over 10
seeds (log-probs × 6 temperatures at the contract's default vocabularies, advantages × 2
``(γ, λ)`` at the default 32K-token long rows) and the broken ones over 3 seeds × 2 settings
(the broken estimators at 2K-token long rows, but those that target ``long_rows``), and prints
the counts. The sweep's points run in one single-threaded process per core. Standalone:
``python -m tests.testing.test_corpus [--quick]`` prints the table (``--quick``: the fast
tier's points).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch
from tests.testing import corpus_advantages, corpus_logprobs, corpus_losses
from tests.testing.corpus_logprobs import Case

from rlops.testing import (
    ADVANTAGE_CHECKS,
    LOGPROB_CHECKS,
    POLICY_LOSS_CHECKS,
    Report,
    check_advantages,
    check_logprobs,
    check_policy_loss,
)

#: contract name -> (the contract, its corpus, its checks)
CONTRACTS: dict[str, tuple[object, ModuleType, tuple[str, ...]]] = {
    "logprobs": (check_logprobs, corpus_logprobs, LOGPROB_CHECKS),
    "losses": (check_policy_loss, corpus_losses, POLICY_LOSS_CHECKS),
    "advantages": (check_advantages, corpus_advantages, ADVANTAGE_CHECKS),
}
#: the fast tier's sizes: log-probs over V = 1000 and 8 rows, advantages' long rows at 2K
SMALL = {"logprobs": {"vocab_sizes": (1000,), "rows": 8}, "advantages": {"long_length": 2048}}
#: the sweep's temperatures (log-probs) and (γ, λ) (advantages; γ alone for returns)
TEMPERATURES = (0.3, 0.5, 0.7, 1.0, 1.3, 2.0)
GAE_SETTINGS = ({}, {"gamma": 0.9, "lam": 0.8})
SEEDS_CORRECT, SEEDS_BROKEN = range(10), range(3)
BROKEN_TEMPERATURES = (1.0, 0.7)


def cases(contract: str, which: str) -> dict[str, Case]:
    """The ``"CORRECT"`` or ``"BROKEN"`` cases of ``contract``'s corpus."""
    return getattr(CONTRACTS[contract][1], which)


def fast_points(contract: str, name: str, case: Case) -> list[dict]:
    """The fast tier's keywords for one case (seed 0)."""
    if contract == "logprobs":
        taus = case.temperatures or ((1.0, 0.7) if case.check is None else (1.0,))
        return [{**SMALL["logprobs"], "temperature": t} for t in taus]
    if contract == "advantages" and not name.startswith("rlops."):
        return [dict(SMALL["advantages"])]  # rlops' own at the default 32K tokens
    return [{}]


def sweep_points(contract: str, case: Case) -> list[dict]:
    """The sweep's keywords for one case: seeds × settings, at the contract's defaults."""
    seeds = SEEDS_CORRECT if case.check is None else SEEDS_BROKEN
    settings: tuple[dict, ...] = ({},)
    if contract == "logprobs":
        taus = case.temperatures or (TEMPERATURES if case.check is None else BROKEN_TEMPERATURES)
        settings = tuple({"temperature": t} for t in taus)
    elif contract == "advantages":
        settings = GAE_SETTINGS
        if case.check not in (None, "long_rows"):  # their check reads no long row
            settings = tuple({**st, **SMALL["advantages"]} for st in settings)
    return [{"seed": s, **st} for s in seeds for st in settings]


def run(contract: str, case: Case, **keywords: object) -> Report:
    """The contract's report on ``case`` with its own options and ``keywords``."""
    check = CONTRACTS[contract][0]
    return check(case.fn, **case.options, **keywords)  # type: ignore[operator]


def problem(contract: str, case: Case, report: Report) -> str | None:
    """What is wrong with the contract's verdict on ``case``, in the report's own figures, or
    None: a correct case with a failed check (a false positive), a broken case whose check
    did not fail (a miss), a function without a temperature whose temperature check was not
    skipped."""
    if case.check is None:
        failed = [f"{c.name} FAIL: {c.figure}" for c in report if c.ok is False]
        if failed:
            return "false positive: " + " | ".join(failed)
        if contract == "logprobs" and case.temperatures == (1.0,):
            c = report["temperature"]
            if c.ok is not None:
                return f"temperature not skipped ({c.status}: {c.figure})"
        return None
    if case.check in report.failed:
        return None
    c = report[case.check]
    return f"miss: {case.check} {c.status}: {c.figure}"


def _ids(points: list[tuple[str, str, dict]]) -> list[str]:
    return [
        f"{c}:{n}:" + ",".join(f"{k}={v}" for k, v in kw.items() if k != "vocab_sizes")
        for c, n, kw in points
    ]


def _fast(which: str) -> list[tuple[str, str, dict]]:
    return [
        (contract, name, kw)
        for contract in CONTRACTS
        for name, case in cases(contract, which).items()
        for kw in fast_points(contract, name, case)
    ]


# --------------------------------------------------------------------------- the corpus itself
def test_the_corpus_is_large_enough_and_covers_every_check():
    """At least 8 correct and 15 broken log-prob functions, 8 broken losses and estimators;
    every check of every contract is the target of a broken implementation."""
    assert len(corpus_logprobs.CORRECT) >= 8 and len(corpus_logprobs.BROKEN) >= 15
    assert len(corpus_losses.BROKEN) >= 8 and len(corpus_advantages.BROKEN) >= 8
    for contract, (_, corpus, checks) in CONTRACTS.items():
        assert {c.check for c in corpus.BROKEN.values()} == set(checks), contract
        assert all(c.check is None for c in corpus.CORRECT.values()), contract


# --------------------------------------------------------------------------- fast tier
_CORRECT, _BROKEN = _fast("CORRECT"), _fast("BROKEN")


@pytest.mark.parametrize("contract, name, keywords", _CORRECT, ids=_ids(_CORRECT))
def test_correct_implementation_passes(contract, name, keywords):
    case = cases(contract, "CORRECT")[name]
    report = run(contract, case, seed=0, **keywords)
    print(report)
    assert problem(contract, case, report) is None, str(report)


@pytest.mark.parametrize("contract, name, keywords", _BROKEN, ids=_ids(_BROKEN))
def test_broken_implementation_fails_its_check(contract, name, keywords):
    case = cases(contract, "BROKEN")[name]
    report = run(contract, case, seed=0, **keywords)
    print(report)
    assert problem(contract, case, report) is None, str(report)
    assert not report


def test_a_function_without_temperature_skips_the_temperature_check():
    case = corpus_logprobs.CORRECT["no_temperature"]
    report = run("logprobs", case, seed=0, temperature=1.0, **SMALL["logprobs"])
    assert report.ok, str(report)
    assert report["temperature"].ok is None, str(report)


# --------------------------------------------------------------------------- the sweep
Point = tuple[str, str, str, dict]  # (contract, "correct" | "broken", name, keywords)


@dataclass
class Tally:
    """The sweep's counts: per (contract, "correct" | "broken") the reports run and their CPU
    seconds, and every false positive, miss or error with where it happened."""

    reports: dict[tuple[str, str], int] = field(default_factory=dict)
    cpu: dict[tuple[str, str], float] = field(default_factory=dict)
    problems: list[tuple[Point, str]] = field(default_factory=list)
    wall: float = 0.0

    def add(self, point: Point, what: str | None, cpu: float) -> None:
        key = point[:2]
        self.reports[key] = self.reports.get(key, 0) + 1
        self.cpu[key] = self.cpu.get(key, 0.0) + cpu
        if what is not None:
            self.problems.append((point, what))

    def count(self, kind: str) -> int:
        """The number of problems of ``kind`` ("false positive", "miss", "error", ...)."""
        return sum(what.startswith(kind) for _, what in self.problems)

    def table(self) -> str:
        lines = [f"{'contract':<11} {'corpus':<8} {'reports':>7} {'wrong':>6} {'cpu s':>8}"]
        for key, n in self.reports.items():
            wrong = sum(p[:2] == key for p, _ in self.problems)
            lines.append(f"{key[0]:<11} {key[1]:<8} {n:>7} {wrong:>6} {self.cpu[key]:8.1f}")
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        fp, miss = self.count("false positive"), self.count("miss")
        return (
            f"corpus sweep: {sum(self.reports.values())} reports, {fp} false positives, "
            f"{miss} misses, {len(self.problems) - fp - miss} other problems "
            f"({self.wall:.0f} s wall, {sum(self.cpu.values()):.0f} s CPU)"
        )

    def details(self) -> str:
        """One line per problem: contract, corpus, implementation, keywords, what went wrong."""
        return "\n".join(f"{c} {w} {n} {kw}: {what}" for (c, w, n, kw), what in self.problems)


def points(quick: bool = False) -> list[Point]:
    """Every case at every sweep point (``quick``: the fast tier's points, at seed 0)."""
    out = []
    for contract in CONTRACTS:
        for which in ("correct", "broken"):
            for name, case in cases(contract, which.upper()).items():
                if quick:
                    kws = [{"seed": 0, **kw} for kw in fast_points(contract, name, case)]
                else:
                    kws = sweep_points(contract, case)
                out += [(contract, which, name, kw) for kw in kws]
    return out


def evaluate(point: Point) -> tuple[str | None, float]:
    """The problem with the contract's verdict at ``point`` (None: right) and the CPU seconds
    it took. The contract raising is a problem too (neither a pass nor a verdict)."""
    contract, which, name, kw = point
    case = cases(contract, which.upper())[name]
    start = time.process_time()
    try:
        what = problem(contract, case, run(contract, case, **kw))
    except Exception as e:
        what = f"error: the contract raised {type(e).__name__}: {e}"
    return what, time.process_time() - start


def _one_thread() -> None:
    torch.set_num_threads(1)  # this worker's own setting: the workers share the cores


def sweep(quick: bool = False, workers: int | None = None, out=sys.stdout) -> Tally:
    """Evaluate every point (:func:`points`) in ``workers`` single-threaded processes (one per
    core by default: the checks' tensors are small, so processes use the cores better than
    intra-op threads), print the counts table and the problems, and return the
    :class:`Tally`."""
    todo = points(quick)
    workers = workers or len(os.sched_getaffinity(0))
    tally, start = Tally(), time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
        for point, (what, cpu) in zip(todo, pool.map(evaluate, todo), strict=True):
            tally.add(point, what, cpu)
    tally.wall = time.perf_counter() - start
    print(tally.table(), file=out)
    if tally.problems:
        print(tally.details(), file=out)
    return tally


@pytest.mark.slow
def test_sweep():
    tally = sweep()
    assert not tally.problems, f"{tally.summary()}\n{tally.details()}"


if __name__ == "__main__":
    sweep(quick="--quick" in sys.argv[1:])
