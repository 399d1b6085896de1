"""The Triton scan family is batch-invariant: a row's bits do not depend on the batch.

Under the CPU interpreter (``TRITON_INTERPRET=1``), through the public functions with
``method="triton"``: each of rows 0, 37 and 63 of a 64-row batch has the same bits alone
(B = 1), in a batch of 3 (in another order) and in the batch of 64 — for
``discounted_cumsum`` with a per-row and a per-token decay (exact cuts) and its gradient,
``gae`` with a mask, dones, a bootstrap and truncation, ``discounted_returns`` and
``reinforce_plus_plus_returns``. T = 600 is three blocks of 256 steps, so the carries between
blocks are in play. The forward passes keep their bits when a row is padded to the right
(mask 0 for the estimators, zeros for the scan) to a longer batch: the blocks start at t = 0
and the padding adds exact identity maps.

The interpreter runs its own tree for ``tl.associative_scan``, not the GPU's; what orders a
row's sums on a GPU is the kernels' compile-time layout (the block, the carry tile, the
warps), so the launches' meta-parameters are checked to be the same whatever B and T
(``benchmarks/gpu.py`` checks the bits on a device).
"""

from __future__ import annotations

import pytest
import torch
from tests._triton_interp import seeded, triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

import rlops
import rlops.advantages.triton as adv_triton
import rlops.scan.triton as scan_triton
from rlops import _backends

T = 600
ROWS = (0, 37, 63)


def _inputs(b: int, t: int) -> dict[str, torch.Tensor]:
    gen = seeded("batch invariance", b, t)
    a = torch.full((b, t), 0.97)
    u = torch.rand(b, t, generator=gen)
    a = torch.where(u < 0.1, torch.rand(b, t, generator=gen), a)
    a = torch.where(u < 0.01, 0.0, a)  # exact cuts
    dones = torch.rand(b, t, generator=gen) < 0.005
    return {
        "x": torch.randn(b, t, generator=gen),
        "a_row": 0.9 + 0.1 * torch.rand(b, 1, generator=gen),
        "a_tok": a,
        "g": torch.randn(b, t, generator=gen),
        "r": torch.randn(b, t, generator=gen),
        "v": torch.randn(b, t, generator=gen),
        "mask": torch.rand(b, t, generator=gen) < 0.8,
        "dones": dones,
        "truncated": dones & (torch.rand(b, t, generator=gen) < 0.5),
        "boot": torch.randn(b, generator=gen),
        "boot_tok": torch.randn(b, t, generator=gen),
        "outcome": torch.randn(b, generator=gen),
    }


def _scan_row(d):
    return (rlops.discounted_cumsum(d["x"], d["a_row"], method="triton"),)


def _scan_token(d):
    return (rlops.discounted_cumsum(d["x"], d["a_tok"], method="triton"),)


def _scan_grad(d):
    x = d["x"].clone().requires_grad_()
    a = d["a_tok"].clone().requires_grad_()
    rlops.discounted_cumsum(x, a, method="triton").backward(d["g"])
    return x.grad, a.grad


def _gae(d):
    return rlops.gae(
        d["r"], d["v"], gamma=0.99, lam=0.95, mask=d["mask"], dones=d["dones"],
        bootstrap=d["boot_tok"], truncated=d["truncated"], method="triton",
    )  # fmt: skip


def _returns(d):
    return (
        rlops.discounted_returns(
            d["r"], gamma=0.99, mask=d["mask"], dones=d["dones"], bootstrap=d["boot"],
            method="triton",
        ),
    )  # fmt: skip


def _reinforce(d):
    return (
        rlops.reinforce_plus_plus_returns(
            d["outcome"], d["r"], d["mask"], kl_coef=0.05, gamma=0.99, method="triton"
        ),
    )


FAMILIES = {
    "discounted_cumsum per-row decay": _scan_row,
    "discounted_cumsum per-token decay": _scan_token,
    "discounted_cumsum gradient": _scan_grad,
    "gae mask+dones+bootstrap+truncated": _gae,
    "discounted_returns mask+dones+bootstrap": _returns,
    "reinforce_plus_plus_returns": _reinforce,
}
# the forward passes, with what pads a row to the right without changing its result
PADDED = {
    "discounted_cumsum per-row decay": {"x": 0.0},
    "gae mask+dones+bootstrap+truncated": {"mask": False, "dones": False, "truncated": False},
    "discounted_returns mask+dones+bootstrap": {"mask": False, "dones": False},
    "reinforce_plus_plus_returns": {"mask": False},
}


def _rows(d, idx):
    return {k: v[list(idx)] for k, v in d.items()}


def _equal(name, got, want):
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (name, k, g.shape, w.shape)
        assert torch.equal(g, w), f"{name}, output {k}: max diff {(g - w).abs().max()}"


@pytest.fixture(autouse=True)
def _kernels_ran(monkeypatch):
    monkeypatch.setattr(_backends, "_failed", {})  # a record of failures this test alone sees
    yield
    assert _backends.failures() == {}, "the kernels were set aside: the chunked path ran"


# the fast tier runs GAE and the per-token scan (the 64-row interpreter runs take seconds each)
FAST = ("gae mask+dones+bootstrap+truncated", "discounted_cumsum per-token decay")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=() if f in FAST else pytest.mark.slow) for f in FAMILIES]
)
def test_a_rows_bits_do_not_depend_on_the_batch(family):
    fn = FAMILIES[family]
    full = _inputs(64, T)
    batch = fn(full)
    three = fn(_rows(full, ROWS[::-1]))  # the rows in another order, in a batch of 3
    for pos, row in enumerate(ROWS):
        alone = fn(_rows(full, [row]))
        _equal(f"{family}: row {row}, B=64 vs B=1", [o[row : row + 1] for o in batch], alone)
        j = len(ROWS) - 1 - pos
        _equal(f"{family}: row {row}, B=3 vs B=1", [o[j : j + 1] for o in three], alone)


@pytest.mark.parametrize("family", PADDED)
def test_a_rows_bits_do_not_depend_on_padding(family):
    fn, pad = FAMILIES[family], PADDED[family]
    short = _inputs(3, T)
    longer = _inputs(3, 2 * T + 100)  # other values past T, then the padding's
    padded = {}
    for k, v in short.items():
        if v.dim() == 2 and v.shape[1] == T:
            tail = longer[k][:, T:].clone()
            if k in pad:
                tail.fill_(pad[k])
            v = torch.cat([v, tail], 1)
        padded[k] = v
    _equal(family, [o[:, :T] for o in fn(padded)], fn(short))


def test_the_kernels_layout_does_not_depend_on_the_shape(monkeypatch):
    """Each kernel's compile-time layout (the block of time, the carry tile, the warps) is
    the same at B = 1 and B = 64, T = 600 and T = 8192 (where a block chosen from the shape
    was 256 steps at B = 1 and 512 at B = 64), and B = 1, T = 2²⁰: nothing launches a variant
    chosen from the shape (the launches are recorded, not run)."""
    seen: dict[tuple[int, int], set] = {}

    def record(shape):
        def launch(kernel, grid, *args, **meta):
            name = getattr(kernel, "__name__", None) or kernel.fn.__name__
            layout = tuple(sorted((k, v) for k, v in meta.items() if k in ("BLOCK", "num_warps")))
            seen.setdefault(shape, set()).add((name, layout))

        return launch

    for b, t in ((1, T), (64, T), (1, 8192), (64, 8192), (1, 2**20)):
        monkeypatch.setattr(scan_triton, "launch", record((b, t)))
        monkeypatch.setattr(adv_triton, "launch", record((b, t)))
        x = torch.zeros(b, t)
        scan_triton.reverse_scan(x, 0.9)
        adv_triton.gae_triton(_gae_inputs(x))
    first = seen[(1, T)]
    assert {name for name, _ in first} == {"_scan_block", "_carry_kernel", "_estimator_block"}
    for shape, layouts in seen.items():
        assert layouts == first, (shape, layouts, first)


def _gae_inputs(x):
    from rlops.advantages._masking import GaeInputs

    g = torch.full((x.shape[0],), 0.99)
    return GaeInputs(x, x, None, None, g, g * 0.95)
