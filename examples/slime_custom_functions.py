"""Plug rlops into slime's custom-function paths: slime loads its rollout-correction function
by dotted path (``--custom-tis-function-path``), so rlops' TIS and IcePop run inside slime with
no edit to slime's code.

Runs against slime where it is installed, else against the stand-in of examples/_standins.py
(slime's ``load_function`` and plain-loop restatements of its TIS and IcePop; it says so when
it is used).

    python examples/slime_custom_functions.py [--small]
"""

import sys
from argparse import Namespace

import _standins  # the stand-in for slime, used only where slime is not installed
import torch

standin = _standins.use_if_absent("slime")
from slime.backends.megatron_utils import loss as slime_loss  # noqa: E402
from slime.utils.misc import load_function  # noqa: E402

# ----------------------------------------------------------------------------- config
samples, max_len = 32, 512  # responses per micro-batch, their longest length
tis = {"tis_clip": 2.0, "tis_clip_low": 0.0}  # slime's --tis-clip, --tis-clip-low
icepop = {"tis_clip": 2.0, "tis_clip_low": 0.5}  # IcePop keeps ratios in [0.5, 2]
seed = 0
if "--small" in sys.argv:
    samples, max_len = 4, 16
# -------------------------------------------------------------------------------------

# A micro-batch as slime's loss holds it: per-sample lists of the response tokens' log-probs
# under the trainer and under the rollout engine, loss masks, and the per-token policy loss.
torch.manual_seed(seed)
lengths = torch.randint(1, max_len + 1, (samples,)).tolist()
train_log_probs = [-torch.rand(n) for n in lengths]
rollout_log_probs = [lp + 0.5 * torch.randn(n) for lp, n in zip(train_log_probs, lengths)]
loss_masks = [torch.ones(n, dtype=torch.int) for n in lengths]
pg_loss = torch.randn(sum(lengths))

print(f"slime: {'STAND-IN (slime is not installed)' if standin else 'installed'}")
for name, options in (("vanilla_tis_function", tis), ("icepop_function", icepop)):
    args = Namespace(use_tis=True, custom_tis_function_path=f"rlops.compat.slime.{name}",
                     **options)
    # policy_loss_function in slime/backends/megatron_utils/loss.py:
    tis_kwargs = {
        "args": args, "pg_loss": pg_loss, "train_log_probs": train_log_probs,
        "rollout_log_probs": rollout_log_probs, "loss_masks": loss_masks,
        "total_lengths": [n + 8 for n in lengths], "response_lengths": lengths,
    }  # fmt: skip
    tis_func = load_function(args.custom_tis_function_path)
    weighted, masks, metrics = tis_func(**tis_kwargs)
    ref, ref_masks, ref_metrics = getattr(slime_loss, name)(**tis_kwargs)  # slime's own
    torch.testing.assert_close(weighted, ref)
    for key in ("tis", "tis_clipfrac", "tis_abs"):
        torch.testing.assert_close(metrics[key], ref_metrics[key].to(metrics[key].dtype))
    assert masks is loss_masks
    print(f"--custom-tis-function-path {args.custom_tis_function_path}: "
          f"{len(pg_loss)} tokens, {metrics['tis_clipfrac'].mean():.1%} clipped or dropped, "
          f"equal to slime's {name}")
