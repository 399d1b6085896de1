"""``rlops check logprobs|loss|advantages MODULE:FUNCTION``: run a :mod:`rlops.testing`
contract on a function of the user's code, print the report, exit 1 if a check failed;
``rlops check mismatch FILE.pt``: diagnose an engine's log-probs against the trainer's logits
(:func:`rlops.testing.diagnose_mismatch`), exit 1 if no hypothesis explains them."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time
from collections.abc import Callable

import torch

from rlops.testing import check_advantages, check_logprobs, check_policy_loss, diagnose_mismatch

__all__ = ["add_arguments", "load_function", "run"]

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


_CHECKS: dict[str, Callable] = {
    "logprobs": check_logprobs,
    "loss": check_policy_loss,
    "advantages": check_advantages,
}
# the parsed arguments that are not options of the check
_NOT_OPTIONS = ("command", "contract", "function", "param", "usage", "file", "shown")
#: ``rlops check mismatch``: the tensors a saved file holds, and the settings it may hold
_MISMATCH_TENSORS = ("engine_logprobs", "logits", "target", "mask", "hidden", "weight")
_MISMATCH_SETTINGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "logit_scale",
    "final_logit_softcapping",
    "rounding",
)


def load_function(spec: str) -> Callable:
    """The function named by ``MODULE:FUNCTION`` (``FUNCTION`` may be dotted:
    ``pkg.mod:Class.method``); the current directory is importable, as for ``python -m``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"expected MODULE:FUNCTION (e.g. my_trainer.losses:ppo_loss), got {spec!r}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as e:  # a syntax error, or the module raised while it was imported
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"importing {module_name} raised {type(e).__name__}: {reason}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj


def _csv(kind: Callable[[str], object]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x)
        except (KeyError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"invalid list {text!r}: {e}") from None

    return parse


def _param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rlops check``'s three contracts and their options, on its parser ``p``."""
    contracts = p.add_subparsers(
        dest="contract", required=True, metavar="{" + ",".join([*_CHECKS, "mismatch"]) + "}"
    )

    def contract(name: str, help_text: str) -> argparse.ArgumentParser:
        c = contracts.add_parser(name, help=help_text, description=help_text)
        c.add_argument("function", metavar="MODULE:FUNCTION", help="the function under test")
        c.add_argument(
            "--device", default="cpu", help="where the inputs are made (default %(default)s)"
        )
        c.add_argument(
            "--seed", type=int, default=0, help="seed of the inputs, >= 0 (default %(default)s)"
        )
        c.set_defaults(usage=c.format_usage())
        return c

    lp = contract(
        "logprobs", "fn(logits [N, V], target [N], temperature) -> logp [N] or (logp, entropy)"
    )
    lp.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="TAU",
        help="the sampling temperature fn applies, > 0 (default %(default)s); a fn that takes "
        "no temperature is checked at 1",
    )
    lp.add_argument(
        "--vocab-sizes",
        type=_csv(int),
        default=(1000, 50257),
        metavar="V,V",
        help="vocabularies of the values checks (default 1000,50257)",
    )
    lp.add_argument(
        "--dtypes",
        type=_csv(lambda s: _DTYPES[s]),
        default=(torch.float32,),
        metavar="DTYPE,...",
        help="logits' dtypes of the values check (default float32)",
    )
    lp.add_argument("--rows", type=int, default=32, help="rows per batch (default 32)")
    lp.add_argument(
        "--bitwise", action="store_true", help="batch_invariance demands identical bits"
    )

    loss = contract(
        "loss", "fn(logp, old_logp, advantages, mask[, num_tokens=, num_seqs=]) -> loss"
    )
    loss.add_argument(
        "--agg", default="token-mean", help="the aggregation mode fn applies (default token-mean)"
    )
    loss.add_argument(
        "--kind", default="ppo", help="the policy-loss kind fn computes (default %(default)s)"
    )
    loss.add_argument(
        "--clip-low",
        type=float,
        default=None,
        metavar="EPS",
        help="the lower clip fn uses, ratio >= 1 - EPS (default: the kind's)",
    )
    loss.add_argument(
        "--clip-high",
        type=float,
        default=None,
        metavar="EPS",
        help="the upper clip fn uses, ratio <= 1 + EPS (default: --clip-low, or the kind's)",
    )
    loss.add_argument(
        "--loss-scale-factor",
        type=float,
        default=None,
        metavar="L",
        help="L of seq-mean-token-sum-norm (default: T, the batch's length)",
    )
    loss.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="NAME=X",
        help="another option of the kind, e.g. dual_clip=3 (repeatable)",
    )

    adv = contract(
        "advantages",
        "fn(rewards, values, mask, gamma, lam) -> advantages "
        "(gae), fn(rewards, mask, gamma) -> returns",
    )
    adv.add_argument(
        "--estimator",
        choices=("gae", "returns"),
        default="gae",
        help="gae: fn(rewards, values, mask, gamma, lam); returns: fn(rewards, mask, gamma) "
        "(default %(default)s)",
    )
    adv.add_argument(
        "--gamma", type=float, default=0.99, help="the discount, in [0, 1] (default %(default)s)"
    )
    adv.add_argument(
        "--lam", type=float, default=0.95, help="GAE's lambda, in [0, 1] (default %(default)s)"
    )
    adv.add_argument(
        "--long-length",
        type=int,
        default=32768,
        metavar="T",
        help="the length of the long_rows check's rows, >= 1 (default %(default)s)",
    )
    _add_mismatch(contracts)


def _add_mismatch(contracts: argparse._SubParsersAction) -> None:
    """``rlops check mismatch FILE.pt`` and its options (each overrides the file's setting)."""
    text = (
        "diagnose why an engine's log-probs differ from the trainer's: FILE.pt is a "
        "torch.save'd dict with engine_logprobs, target, logits (or hidden and weight), "
        "optionally mask and the sampler's settings"
    )
    m = contracts.add_parser("mismatch", help=text, description=text)
    m.add_argument("file", metavar="FILE.pt", help="the saved dict of tensors")
    for name, kind, what in (
        ("temperature", float, "the sampling temperature, > 0"),
        ("top_k", int, "the sampler's top-k, >= 1 (-1 or 0: off)"),
        ("top_p", float, "the sampler's top-p, in (0, 1]"),
        ("min_p", float, "the sampler's min-p, in [0, 1]"),
        ("logit_scale", float, "the model head's logit scale, > 0"),
        ("final_logit_softcapping", float, "the model head's final softcap, > 0"),
    ):
        m.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"{what} (default: the file's, else none)",
        )
    m.add_argument(
        "--rounding",
        choices=("bfloat16", "float16"),
        default=None,
        help="the 16-bit dtype of the engine's logits (default: the file's, else that of the "
        "operands, else bfloat16)",
    )
    m.add_argument(
        "--shown", type=int, default=12, help="hypotheses shown in the table (default 12)"
    )
    m.set_defaults(usage=m.format_usage())


def _run_mismatch(args: argparse.Namespace) -> int:
    """``rlops check mismatch``: 0 if a hypothesis explains the engine's log-probs, 1 if none
    does, 2 on a usage error (a file that cannot be read, a missing key, a bad value)."""
    try:
        saved = torch.load(args.file, map_location="cpu", weights_only=True)
    except Exception as e:  # a missing file, not a torch.save'd file, pickled code
        reason = (str(e).strip().splitlines() or [""])[0]
        return _usage_error(args, f"cannot read {args.file}: {type(e).__name__}: {reason}")
    if not isinstance(saved, dict):
        return _usage_error(args, f"{args.file} must hold a dict, got {type(saved).__name__}")
    known = {*_MISMATCH_TENSORS, *_MISMATCH_SETTINGS}
    unknown = sorted(str(k) for k in saved if k not in known)
    if unknown:
        return _usage_error(args, f"{args.file} has unknown keys {unknown}: expected {known}")
    missing = [k for k in ("engine_logprobs", "target") if k not in saved]
    if missing:
        return _usage_error(args, f"{args.file} has no {' or '.join(missing)}")
    settings = {k: saved[k] for k in _MISMATCH_SETTINGS if k in saved}
    given = {k: getattr(args, k) for k in _MISMATCH_SETTINGS if getattr(args, k) is not None}
    settings.update(given)
    if isinstance(settings.get("rounding"), str):
        settings["rounding"] = _DTYPES.get(settings["rounding"], settings["rounding"])
    if args.shown < 1:
        return _usage_error(args, f"argument --shown: must be >= 1, got {args.shown}")
    start = time.perf_counter()
    try:
        report = diagnose_mismatch(
            saved["engine_logprobs"],
            saved.get("logits"),
            saved["target"],
            saved.get("mask"),
            hidden=saved.get("hidden"),
            weight=saved.get("weight"),
            **settings,
        )
    except (TypeError, ValueError) as e:
        message = str(e)
        if not any(re.match(rf"{name}\b", message) for name in given):
            message = f"{args.file}: {message}"  # a value of the file, not an option
        return _usage_error(args, message)
    print(report.table(args.shown))
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0 if report.explained else 1


def _usage_error(args: argparse.Namespace, message: str) -> int:
    """Print the contract's usage and ``message`` as argparse does, naming the command-line
    option where the message names its keyword (``clip_low`` -> ``--clip-low``); return 2."""
    for name in vars(args):
        if name not in _NOT_OPTIONS and re.match(rf"{name}\b", message):
            message = f"argument --{name.replace('_', '-')}: {message}"
            break
    else:
        for name, _ in getattr(args, "param", ()):
            if re.search(rf"\b{re.escape(name)}\b", message):
                message = f"argument --param {name}: {message}"
                break
    usage = getattr(args, "usage", "")
    print(f"{usage}rlops check {args.contract}: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """``rlops check``: 0 if every check passed, 1 if one failed, 2 on a usage error (a bad
    option value, a function that cannot be loaded or whose signature fits no form);
    ``mismatch``: see :func:`_run_mismatch`."""
    if args.contract == "mismatch":
        return _run_mismatch(args)
    try:
        fn = load_function(args.function)
    except (ImportError, ValueError) as e:
        return _usage_error(args, str(e))
    # every option of a contract is its check's keyword of the same name (device and seed too)
    options = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    kind_params = dict(getattr(args, "param", ()))  # loss: the kind's further options
    start = time.perf_counter()
    try:
        report = _CHECKS[args.contract](fn, **options, **kind_params)
    except (TypeError, ValueError) as e:
        return _usage_error(args, str(e))
    print(report)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0 if report.ok else 1
