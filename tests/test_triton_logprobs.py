"""The Triton log-prob and entropy kernels under the CPU interpreter, against the reference.

Forward and backward of :func:`rlops.logprobs.triton.logprobs_and_entropy_triton` against the
unfused reference (:mod:`rlops.logprobs.reference`): float32 results within twice the float32
reference's error against float64 (gradients three times), half-precision gradients against
the float32 reference's rounded to their dtype. Vocabulary tiles smaller than the vocabulary
(``block_v``), so that the online log-sum-exp crosses tiles; shard statistics at an offset
merge to the whole vocabulary's.
"""

from __future__ import annotations

import pytest
import torch
from tests._logprobs_util import assert_as_accurate, forward_backward
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

from rlops.logprobs import _shard, _support
from rlops.logprobs.reference import logprobs_and_entropy_reference as reference
from rlops.logprobs.triton import logits_grad, logprobs_and_entropy_triton, shard_stats

FACTOR_FWD, FACTOR_GRAD = 2.0, 3.0

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on masked lanes


def _data(n, v, *, scale=3.0, seed=0, keep_frac=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    keep = None
    if keep_frac is not None:
        keep = torch.rand(n, v, generator=gen) < keep_frac
        keep.scatter_(-1, target.unsqueeze(-1), False)  # the op must keep the target anyway
    grads = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return logits, target, keep, grads


def _triton_fn(**kw):
    return lambda x, y: logprobs_and_entropy_triton(x, y, block_n=16, block_v=256, **kw)


def _check(logits, target, grads, **kw):
    ref_kw = {k: v for k, v in kw.items() if k in ("temperature", "keep_mask")}
    fast = forward_backward(_triton_fn(**kw), (logits, target), grads)
    half = logits.dtype in (torch.bfloat16, torch.float16)
    ref32 = forward_backward(reference, (logits.float(), target), grads, **ref_kw)
    exact = forward_backward(reference, (logits.double(), target), grads, **ref_kw)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert fast[0].dtype == fast[1].dtype == acc and fast[2].dtype == logits.dtype
    if logits.dtype == torch.float64:  # float64: the float64 reference is the yardstick
        ref32 = forward_backward(reference, (logits, target), grads, **ref_kw)
        torch.testing.assert_close(fast[0], ref32[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fast[1], ref32[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fast[2], ref32[2], rtol=1e-12, atol=1e-12)
        return
    assert_as_accurate(fast[0], ref32[0], exact[0], FACTOR_FWD, "logp")
    assert_as_accurate(fast[1], ref32[1], exact[1], FACTOR_FWD, "entropy")
    ref_grad = ref32[2].to(logits.dtype) if half else ref32[2]
    assert_as_accurate(fast[2], ref_grad, exact[2], FACTOR_GRAD, "grad")


@pytest.mark.parametrize("v", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(v, masked):
    logits, target, keep, grads = _data(37, v, seed=v, keep_frac=0.4 if masked else None)
    _check(logits, target, grads, keep_mask=keep)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature(temperature):
    logits, target, keep, grads = _data(20, 300, seed=3, keep_frac=0.5)
    _check(logits, target, grads, temperature=temperature)
    _check(logits, target, grads, temperature=temperature, keep_mask=keep)


def test_large_vocab_and_offset_logits():
    """V = 4096 over 16 tiles, logits around 1e3: the entropy's terms do not cancel."""
    logits, target, _, grads = _data(8, 4096, scale=10.0, seed=4)
    _check(logits + 1e3, target, grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    logits, target, keep, grads = _data(19, 333, seed=5, keep_frac=0.5, dtype=dtype)
    _check(logits, target, grads)
    _check(logits, target, grads, keep_mask=keep, temperature=0.8)


def test_sampler_threshold_matches_top_k_mask():
    """A per-token threshold (as the fused path computes it for top-k / top-p) gives the
    log-prob of the support ``z ≥ t`` with the target kept; the entropy stays unmasked."""
    logits, target, _, grads = _data(24, 500, seed=6)
    z = logits / 0.9
    thr = _support.threshold_chunk(z, 20, 0.9, None)
    keep = z >= thr
    fast = forward_backward(_triton_fn(temperature=0.9, threshold=thr.squeeze(1)),
                            (logits, target), grads)
    masked = forward_backward(_triton_fn(temperature=0.9, keep_mask=keep), (logits, target),
                              grads)
    for a, b in zip(fast, masked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _check(logits, target, grads, temperature=0.9, keep_mask=keep)


def test_entropy_flags():
    logits, target, _, grads = _data(10, 200, seed=7)
    lp, ent = logprobs_and_entropy_triton(logits, target, with_entropy=False, block_v=64)
    assert ent is None
    torch.testing.assert_close(lp, reference(logits, target)[0])
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy_triton(x, target, entropy_grad=False, block_v=64)
    assert not ent.requires_grad
    lp.backward(grads[0])
    x2 = logits.clone().requires_grad_()
    reference(x2, target)[0].backward(grads[0])
    torch.testing.assert_close(x.grad, x2.grad)


def test_minus_inf_logits():
    """A -inf logit has probability 0: the results are those of the finite logits alone, and
    its gradient is 0 (the reference's entropy is NaN there: 0 * -inf)."""
    logits, target, _, grads = _data(6, 100, seed=8)
    target = target % 50
    finite = logits[:, :50].clone()
    logits[:, 50:] = float("-inf")
    fast = forward_backward(_triton_fn(), (logits, target), grads)
    ref = forward_backward(reference, (finite, target), grads)
    torch.testing.assert_close(fast[0], ref[0])
    torch.testing.assert_close(fast[1], ref[1])
    torch.testing.assert_close(fast[2][:, :50], ref[2])
    assert (fast[2][:, 50:] == 0).all()


@pytest.mark.parametrize("masked", [False, True])
def test_shards_merge_to_the_whole_vocabulary(masked):
    """Statistics of two vocabulary shards (unequal sizes, the second at an offset), merged as
    under tensor parallelism, give the reference; each shard's gradient is the matching slice
    of the reference's."""
    logits, target, keep, grads = _data(21, 300, seed=9, keep_frac=0.5 if masked else None)
    cuts = [(0, 128), (128, 300)]
    stats = torch.stack([
        shard_stats(logits[:, a:b], target, offset=a, temperature=1.3, block_n=8, block_v=64,
                    keep_mask=None if keep is None else keep[:, a:b])
        for a, b in cuts
    ])  # fmt: skip
    logp, ent, saved = _shard.merge(stats, masked, True)
    ref_lp, ref_ent = reference(logits.double(), target, temperature=1.3, keep_mask=keep)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    saved5 = torch.stack(saved if masked else (saved[0], saved[1], *saved[2:]))
    if not masked:
        saved5 = torch.stack([saved[0], saved[1], saved[0], saved[1], saved[4]])
    x = logits.double().requires_grad_()
    lp, en = reference(x, target, temperature=1.3, keep_mask=keep)
    torch.autograd.backward([lp, en], [grads[0].double(), grads[1].double()])
    for a, b in cuts:
        g = logits_grad(logits[:, a:b], target, saved5, grads[0], grads[1], offset=a,
                        temperature=1.3, keep_mask=None if keep is None else keep[:, a:b],
                        block_n=8, block_v=64)  # fmt: skip
        torch.testing.assert_close(g.double(), x.grad[:, a:b], rtol=1e-4, atol=1e-5)
