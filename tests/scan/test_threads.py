"""The CPU thread pool (``rlops._threads``): the same results as a plain loop, the caller's
thread-local modes in every item, errors raised, nested calls serial."""

from __future__ import annotations

import threading
from concurrent.futures.thread import BrokenThreadPool

import pytest
import torch

from rlops._threads import for_each

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_items_run_once_each_on_the_pool(two_threads):
    seen, names = [], set()
    lock = threading.Lock()

    def body(i):
        with lock:
            seen.append(i)
            names.add(threading.current_thread().name)

    for_each(body, range(50), CPU)
    assert sorted(seen) == list(range(50))
    assert all(n.startswith("rlops") for n in names)


def test_workers_run_torch_single_threaded_and_nested_calls_are_serial(two_threads):
    counts, nested_ok = [], []

    def body(i):
        counts.append(torch.get_num_threads())
        me = threading.current_thread().name
        names = []
        for_each(lambda j: names.append(threading.current_thread().name), [0, 1], CPU)
        nested_ok.append(names == [me, me])

    for_each(body, range(4), CPU)
    assert counts == [1] * 4
    assert nested_ok == [True] * 4
    assert torch.get_num_threads() == 2  # the caller's own count is untouched


def test_one_thread_or_another_device_is_a_plain_loop():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = []
        for_each(lambda i: names.append(threading.current_thread().name), range(3), CPU)
        assert names == [threading.current_thread().name] * 3
    finally:
        torch.set_num_threads(before)
    names = []
    meta = torch.device("meta")
    for_each(lambda i: names.append(threading.current_thread().name), range(3), meta)
    assert names == [threading.current_thread().name] * 3


@pytest.mark.parametrize("grad", [False, True])
def test_grad_and_inference_modes_follow_the_caller(two_threads, grad):
    modes = []
    with torch.set_grad_enabled(grad):
        for_each(lambda i: modes.append(torch.is_grad_enabled()), range(4), CPU)
    assert modes == [grad] * 4
    out = []
    with torch.inference_mode():
        buf = torch.zeros(4)  # an inference tensor: writable only in inference mode

        def write(i):
            buf[i] = i
            out.append(torch.is_inference_mode_enabled())

        for_each(write, range(4), CPU)
    assert out == [True] * 4 and buf.tolist() == [0, 1, 2, 3]


def test_an_error_in_an_item_is_raised_after_all_items_ran(two_threads):
    ran = []

    def body(i):
        ran.append(i)
        if i == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        for_each(body, range(8), CPU)
    assert sorted(ran) == list(range(8))


def test_starting_the_workers_leaves_the_default_of_new_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # a pool size no other test uses: its workers start here
    try:
        for_each(lambda i: None, range(6), CPU)
        new = []
        t = threading.Thread(target=lambda: new.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert new == [3]
    finally:
        torch.set_num_threads(before)


def test_every_worker_is_ready_when_the_first_call_returns(monkeypatch):
    """The race behind a worker that starts late: items are taken by the workers that are up,
    the call returns, and a late worker then sets the default of new threads to 1 while the
    caller goes on. Here one worker is made slow to start; the pool must wait for it."""
    import rlops._threads as threads

    original, ready = threads._one_thread, []

    def slow_third_worker():
        if threading.current_thread().name.endswith("_2"):
            threading.Event().wait(0.2)  # a worker that the OS schedules late
        original()
        ready.append(threading.current_thread().name)

    monkeypatch.setattr(threads, "_one_thread", slow_third_worker)
    before = torch.get_num_threads()
    torch.set_num_threads(5)  # a pool size no other test uses: its workers start here
    try:
        for_each(lambda i: None, range(6), CPU)
        assert len(ready) == 5  # every worker initialised before the call returned
        new = []
        t = threading.Thread(target=lambda: new.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert new == [5]
    finally:
        torch.set_num_threads(before)


def test_a_worker_that_fails_to_start_raises_instead_of_hanging(monkeypatch):
    import rlops._threads as threads

    def broken():
        raise RuntimeError("worker start failed")

    monkeypatch.setattr(threads, "_one_thread", broken)
    before = torch.get_num_threads()
    torch.set_num_threads(6)  # a pool size no other test uses
    try:
        with pytest.raises(BrokenThreadPool):
            for_each(lambda i: None, range(6), CPU)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"with_entropy": False}])
def test_fused_logprobs_on_the_pool_equal_the_serial_loop_bitwise(kw):
    """The logits op spreads its chunks over the pool: the same bits as one thread."""
    from rlops.logprobs import logprobs_and_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(257, 300, generator=gen) * 3
    target = torch.randint(0, 300, (257,), generator=gen)
    g = torch.randn(2, 257, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = logits.clone().requires_grad_()
            lp, ent = logprobs_and_entropy(x, target, chunk_size=16, **kw)
            outs = [lp] if ent is None else [lp, ent]
            torch.autograd.backward(outs, list(g[: len(outs)]))
            results.append([*(o.detach() for o in outs), x.grad])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
