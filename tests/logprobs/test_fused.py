"""Fused log-probs and entropy from logits vs the unfused reference, in one process."""

from __future__ import annotations

import math

import pytest
import torch
from tests._logprobs_util import assert_as_accurate, forward_backward, nan_filled_empty

from rlops.logprobs import logprobs_and_entropy
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0


def _data(shape, v, *, scale=3.0, seed=0, keep_frac=None):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=gen) * scale).float()
    target = torch.randint(0, v, shape, generator=gen)
    keep = None
    if keep_frac is not None:
        keep = torch.rand(*shape, v, generator=gen) < keep_frac
        # make sure some targets are *not* in the mask: the op must keep them anyway
        keep.scatter_(-1, target.unsqueeze(-1), False)
    grads = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)]
    return logits, target, keep, grads


def _check_against_reference(logits, target, grads, **kw):
    """Fused float32 vs float64 reference, with the float32 reference's error as the yardstick."""
    ref_kw = {k: v for k, v in kw.items() if k in ("temperature", "keep_mask")}
    fast = forward_backward(logits_fn(kw), (logits, target), grads)
    ref32 = forward_backward(reference, (logits, target), grads, **ref_kw)
    exact = forward_backward(reference, (logits.double(), target), grads, **ref_kw)
    for k, (what, factor) in enumerate(
        [("logp", FACTOR_FWD), ("entropy", FACTOR_FWD), ("grad", FACTOR_GRAD)]
    ):
        assert fast[k].dtype == (torch.float32 if k < 2 else logits.dtype)
        assert_as_accurate(fast[k], ref32[k], exact[k], factor, what)
    return fast


def logits_fn(kw):
    return lambda x, y: logprobs_and_entropy(x, y, **kw)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(chunk_size, temperature, masked):
    # 3 x 13 = 39 tokens: no chunk size above divides it; V = 97 is odd.
    logits, target, keep, grads = _data((3, 13), 97, keep_frac=0.4 if masked else None)
    with nan_filled_empty():
        _check_against_reference(
            logits, target, grads, temperature=temperature, keep_mask=keep, chunk_size=chunk_size
        )


@pytest.mark.parametrize("scale,offset", [(1.0, 0.0), (10.0, 0.0), (3.0, 1e4), (30.0, 1e3)])
def test_float32_accuracy_large_vocab(scale, offset):
    """Entropy stays exact where lse − Σp·z would cancel (large common offset)."""
    logits, target, _, grads = _data((48,), 3001, scale=scale, seed=1)
    logits = logits + offset
    _check_against_reference(logits, target, grads)
    _check_against_reference(
        logits, target, grads, temperature=0.5, keep_mask=torch.rand(logits.shape) < 0.3
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    logits, target, keep, grads = _data((5, 11), 257, seed=2, keep_frac=0.5)
    logits = logits.to(dtype)
    for kw in ({}, {"keep_mask": keep, "temperature": 1.7, "chunk_size": 4}):
        fast = forward_backward(logits_fn(kw), (logits, target), grads)
        ref_kw = {k: v for k, v in kw.items() if k != "chunk_size"}
        # Same half-precision values, upcast: the float32 reference is the yardstick forward.
        ref32 = forward_backward(reference, (logits.float(), target), grads, **ref_kw)
        exact = forward_backward(reference, (logits.double(), target), grads, **ref_kw)
        assert fast[0].dtype == fast[1].dtype == torch.float32 and fast[2].dtype == dtype
        assert_as_accurate(fast[0], ref32[0], exact[0], FACTOR_FWD, "logp")
        assert_as_accurate(fast[1], ref32[1], exact[1], FACTOR_FWD, "entropy")
        # The gradient comes back in the input dtype: compare with the float32 reference's
        # gradient rounded to that dtype.
        assert_as_accurate(fast[2], ref32[2].to(dtype), exact[2], FACTOR_GRAD, "grad")


def test_chunk_sizes_agree():
    logits, target, keep, grads = _data((50,), 33, seed=3, keep_frac=0.5)
    runs = [
        forward_backward(logits_fn({"chunk_size": c, "keep_mask": keep}), (logits, target), grads)
        for c in (1, 7, 64, None)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # rows are independent


def test_float64_stays_float64():
    logits, target, _, grads = _data((4,), 9, seed=5)
    lp, ent, g = forward_backward(logits_fn({}), (logits.double(), target), grads)
    assert lp.dtype == ent.dtype == g.dtype == torch.float64


def test_empty_inputs():
    for shape in [(0, 7), (2, 0, 7)]:
        logits = torch.randn(shape, requires_grad=True)
        target = torch.zeros(shape[:-1], dtype=torch.long)
        lp, ent = logprobs_and_entropy(logits, target, keep_mask=torch.ones(shape, dtype=bool))
        assert lp.shape == ent.shape == shape[:-1]
        (lp.sum() + ent.sum()).backward()
        assert logits.grad.shape == shape


def test_without_entropy_and_entropy_grad_off():
    logits, target, keep, grads = _data((9,), 21, seed=6, keep_frac=0.5)
    full = forward_backward(logits_fn({"keep_mask": keep}), (logits, target), [grads[0], None])
    lp, ent, g = forward_backward(
        logits_fn({"keep_mask": keep, "with_entropy": False}), (logits, target), [grads[0], None]
    )
    assert ent is None
    torch.testing.assert_close(lp, full[0], rtol=0, atol=0)
    torch.testing.assert_close(g, full[2], rtol=0, atol=0)
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, target, keep_mask=keep, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(ent, full[1], rtol=0, atol=0)
    lp.backward(grads[0])
    torch.testing.assert_close(x.grad, full[2], rtol=0, atol=0)


def _saved_sizes(**kw):
    """Numels of the tensors autograd saves for the op, other than the inputs themselves."""
    logits, target, keep, _ = _data((40,), 100, seed=7, keep_frac=0.5)
    x = logits.clone().requires_grad_()
    kw = {"keep_mask": keep, **kw} if kw.pop("masked", False) else kw
    inputs = {x.data_ptr(), target.data_ptr()} | ({keep.data_ptr()} if "keep_mask" in kw else set())
    sizes = []

    def pack(t):
        if t.data_ptr() not in inputs:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_and_entropy(x, target, **kw)
    return sizes


def test_saved_state_is_per_token():
    n = 40
    assert _saved_sizes() == [n] * 3  # (M, log S, H)
    assert _saved_sizes(entropy_grad=False) == [n] * 2  # nothing kept for the entropy
    assert _saved_sizes(with_entropy=False) == [n] * 2
    assert _saved_sizes(masked=True) == [n] * 5


def test_non_contiguous_logits():
    logits, target, _, grads = _data((3, 8), 17, seed=8)
    wide = torch.randn(3, 9, 17)
    wide[:, :-1] = logits
    view = wide[:, :-1]  # the usual shift by one token: not viewable as [N, V]
    a = forward_backward(logits_fn({"chunk_size": 5}), (view, target), grads)
    b = forward_backward(logits_fn({"chunk_size": 5}), (logits, target), grads)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_extreme_logits_are_finite():
    gen = torch.Generator().manual_seed(9)
    n, v = 16, 64
    target = torch.randint(0, v, (n,), generator=gen)
    signs = torch.where(torch.rand(n, v, generator=gen) < 0.5, -1.0, 1.0)
    keep_only_target = torch.zeros(n, v, dtype=torch.bool)
    cases = {
        "+-1e4": (signs * 1e4, None),
        "all equal": (torch.full((n, v), 7.0), None),
        "all equal 1e4": (torch.full((n, v), -1e4), None),
        "keep only target": (torch.randn(n, v, generator=gen) * 5, keep_only_target),
        "+-1e4 masked": (signs * 1e4, torch.rand(n, v, generator=gen) < 0.1),
    }
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    for name, (logits, keep) in cases.items():
        for tau in (0.5, 1.0):
            kw = {"keep_mask": keep, "temperature": tau}
            fast = forward_backward(logits_fn(kw), (logits, target), grads)
            exact = forward_backward(reference, (logits.double(), target), grads, **kw)
            for k, what in enumerate(["logp", "entropy", "grad"]):
                assert torch.isfinite(fast[k]).all(), (name, what)
                torch.testing.assert_close(
                    fast[k].double(), exact[k], rtol=1e-5, atol=1e-4, msg=f"{name} {what}"
                )
    lp, ent = logprobs_and_entropy(torch.full((2, v), 3.0), target[:2])
    torch.testing.assert_close(lp, torch.full((2,), -math.log(v)))
    torch.testing.assert_close(ent, torch.full((2,), math.log(v)))
    lp, _ = logprobs_and_entropy(torch.randn(2, v), target[:2], keep_mask=keep_only_target[:2])
    assert (lp == 0).all()


def test_minus_inf_logits_are_probability_zero():
    """-inf in the logits themselves (a masked vocabulary): finite entropy and gradients."""
    logits, target, _, grads = _data((12,), 40, seed=10)
    logits[:, ::3] = float("-inf")
    target = (target // 3) * 3 + 1  # targets on finite logits
    fast = forward_backward(logits_fn({"chunk_size": 5}), (logits, target), grads)
    exact = forward_backward(reference, (logits.double().clamp(min=-1e300), target), grads)
    for k, what in enumerate(["logp", "entropy", "grad"]):
        assert torch.isfinite(fast[k]).all(), what
        torch.testing.assert_close(fast[k].double(), exact[k], rtol=1e-5, atol=1e-6)


BAD = [
    ({"target": torch.tensor([0, 5])}, ValueError, "target must hold vocabulary ids in"),
    ({"target": torch.tensor([0, -1])}, ValueError, "target must hold vocabulary ids in"),
    ({"target": torch.tensor([0, 1, 2])}, ValueError, "target must have shape"),
    ({"target": torch.tensor([0.0, 1.0])}, TypeError, "target must be an integer"),
    ({"logits": torch.zeros(2, 5, dtype=torch.long)}, TypeError, "logits must be a floating"),
    ({"logits": torch.zeros(2, 0)}, ValueError, "non-empty vocabulary"),
    ({"temperature": 0.0}, ValueError, "temperature must be"),
    ({"temperature": -1.0}, ValueError, "temperature must be"),
    ({"temperature": float("nan")}, ValueError, "temperature must be"),
    ({"temperature": "1"}, TypeError, "temperature must be"),
    ({"keep_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError, "keep_mask must have shape"),
    ({"keep_mask": torch.ones(2, 5)}, TypeError, "keep_mask must be a bool"),
    ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
    ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int"),
    ({"with_entropy": 1}, TypeError, "with_entropy must be a bool"),
    ({"group": object()}, TypeError, r"group must be a torch\.distributed\.ProcessGroup"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_inputs(change, error, match):
    args = {"logits": torch.zeros(2, 5), "target": torch.tensor([0, 4]), **change}
    logits, target = args.pop("logits"), args.pop("target")
    with pytest.raises(error, match=match):
        logprobs_and_entropy(logits, target, **args)


def test_exports():
    import rlops.logprobs

    assert rlops.logprobs.__all__ == [
        "LogprobOptions",
        "copy_to_tensor_parallel_region",
        "linear_logprobs_and_entropy",
        "logprobs_and_entropy",
    ]


def test_default_chunk_bounds_the_temporaries():
    from rlops.logprobs._options import default_chunk

    cpu = torch.device("cpu")
    for n, v in [(1, 1), (10, 5), (131072, 32000), (131072, 152064), (7, 10**8)]:
        c = default_chunk(n, v, cpu)
        assert 1 <= c <= max(n, 1)
        assert c == 1 or c * v * 4 <= 4 << 20
    assert default_chunk(0, 50, cpu) == 1


def test_with_entropy_overloads():
    """Type checkers see ``(Tensor, Tensor)`` for ``with_entropy=True`` (the default) and
    ``(Tensor, None)`` for ``with_entropy=False``, with a third ``Tensor`` for
    ``with_sum_pi_squared=True``, on both ops."""
    from typing import Literal, get_overloads, get_type_hints

    from rlops.logprobs import linear_logprobs_and_entropy

    t, f = Literal[True], Literal[False]
    tensor, maybe = torch.Tensor, torch.Tensor | None
    for fn in (logprobs_and_entropy, linear_logprobs_and_entropy):
        hints = [get_type_hints(o) for o in get_overloads(fn)]
        returns = {(h["with_entropy"], h["with_sum_pi_squared"]): h["return"] for h in hints}
        assert returns[t, f] == tuple[tensor, tensor]
        assert returns[f, f] == tuple[tensor, None]
        assert returns[bool, f] == tuple[tensor, maybe]
        assert returns[t, t] == tuple[tensor, tensor, tensor]
        assert returns[f, t] == tuple[tensor, None, tensor]
        assert returns[bool, t] == tuple[tensor, maybe, tensor]
        assert returns[bool, bool] == tuple[tensor, maybe] | tuple[tensor, maybe, tensor]
        x = torch.zeros(2, 3)
        args = (
            (x, torch.zeros(2, dtype=torch.long))
            if fn is logprobs_and_entropy
            else (x, torch.zeros(4, 3), torch.zeros(2, dtype=torch.long))
        )
        assert fn(*args, with_entropy=False)[1] is None
        assert isinstance(fn(*args)[1], torch.Tensor)
        assert len(fn(*args)) == 2
        out = fn(*args, with_entropy=False, with_sum_pi_squared=True)
        assert len(out) == 3 and out[1] is None and isinstance(out[2], torch.Tensor)


def test_softcap_and_csr_support_hand_computed():
    """Formerly examples of the op's docstring: a softcap of 1 maps logits (0, 100) to
    (0, tanh 100 = 1); CSR kept sets: row 0 keeps {2} (and its target 1), row 1 keeps {1, 3}
    and its target 0."""
    logp = logprobs_and_entropy(
        torch.tensor([[0.0, 100.0]]), torch.tensor([0]), final_logit_softcapping=1.0
    )[0]
    assert repr(logp) == "tensor([-1.3133])"
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, -1.0]])
    ids, offsets = torch.tensor([2, 1, 3]), torch.tensor([0, 1, 3])
    logp = logprobs_and_entropy(
        logits, torch.tensor([1, 0]), support_ids=ids, support_offsets=offsets
    )[0]
    assert repr(logp) == "tensor([-0.6931, -0.1698])"
