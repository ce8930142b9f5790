"""GradientReducer on one rank: bucket layout, hooks, unused parameters, accumulation, off."""
import contextlib
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl.buckets import tail_start
from hpcdl.comm.reducer import GradientReducer, layout_buckets


@pytest.fixture(scope="module")
def comm():
    c = hpcdl.comm.init("mpi", MPI.COMM_WORLD)
    yield c
    c.close()


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``forward(x, use_b=False)`` leaves head b without a gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x, use_b=True):
        h = torch.relu(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def test_buckets_follow_reverse_registration_order_and_size():
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5])]
    buckets = layout_buckets(params[::-1], bucket_bytes=4 * 20)
    assert [b.names for b in buckets] == [["p3"], ["p2"], ["p1", "p0"]]
    assert [b.offsets for b in buckets] == [[0], [0], [0, 10]]


def test_parameter_larger_than_a_bucket_gets_its_own():
    buckets = layout_buckets([("big", torch.zeros(100)), ("small", torch.zeros(1))], 16)
    assert [b.names for b in buckets] == [["big"], ["small"]]


def test_first_layers_get_a_small_last_bucket_of_their_own():
    # Registration order p0..p4: p0, p1 are the first layers, their gradients come last.
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([3, 5, 40, 40, 40])]
    buckets = layout_buckets(params[::-1], bucket_bytes=4 * 100, last_bucket_bytes=4 * 10)
    assert [b.names for b in buckets] == [["p4", "p3"], ["p2"], ["p1", "p0"]]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert buckets[-1].numel == 8


def test_tail_start_splits_off_the_longest_suffix_that_fits():
    sizes = [4 * 40, 4 * 5, 4 * 3]
    assert tail_start(sizes, None) == 3
    assert tail_start(sizes, 4 * 2) == 3            # nothing fits
    assert tail_start(sizes, 4 * 1000) == 3         # everything fits: no split
    assert tail_start(sizes, 4 * 8) == 1            # the last two


def test_gradients_view_the_buckets_until_close(comm):
    model = TwoHeads()
    reducer = GradientReducer(comm, model.named_parameters(), bucket_bytes=64)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        reducer.arm(last=True)
        model(torch.ones(2, 4)).sum().backward()
        reducer.synchronize()
    inside = [any(b.buffer.data_ptr() <= p.grad.data_ptr()
                  < b.buffer.data_ptr() + b.buffer.numel() * 4 for b in reducer.buckets)
              for p in model.parameters()]
    assert all(inside)  # no copy back out of the buckets
    values = [p.grad.clone() for p in model.parameters()]
    reducer.close()     # the backend may free the buckets: gradients get their own memory
    for p, value in zip(model.parameters(), values, strict=True):
        assert all(p.grad.data_ptr() != b.buffer.data_ptr() for b in reducer.buckets)
        assert torch.equal(p.grad, value)


def test_zero_grad_keeping_the_views_still_reduces_each_step(comm):
    model = TwoHeads()
    x = torch.arange(8.0).view(2, 4)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=64) as reducer:
        for _ in range(3):
            model.zero_grad(set_to_none=False)  # zeroes the bucket views in place
            reducer.arm(last=True)
            model(x).sum().backward()
            reducer.synchronize()
            for p, g in zip(model.parameters(), expected, strict=True):
                assert torch.allclose(p.grad, g)


def test_only_the_marked_thread_waits_yielding():
    import threading

    from hpcdl.comm.base import waits_yield_in_this_thread, yield_waits_in_this_thread

    seen = []

    def worker():
        seen.append(waits_yield_in_this_thread())
        yield_waits_in_this_thread()
        seen.append(waits_yield_in_this_thread())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [False, True]
    assert not waits_yield_in_this_thread()  # the main thread still spins


class UnusedFirst(torch.nn.Module):
    """A layer registered first that forward never uses: its bucket is launched last, by
    ``synchronize`` itself (zeros), after the used layer's went out during backward."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)
        self.used = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


def test_the_threads_waits_are_patient_beside_backward_and_urgent_once_the_step_waits(comm):
    from hpcdl.comm.base import PATIENT_WAIT_S, URGENT_WAIT_S, wait_ceiling_s

    model = UnusedFirst()
    seen = []   # (bucket's first parameter, the thread's sleep ceiling inside its allreduce)
    original = comm.allreduce_flat_

    def recording(buf, average=True):
        seen.append((int(buf.numel()), wait_ceiling_s()))
        return original(buf, average=average)

    comm.allreduce_flat_ = recording
    try:
        with GradientReducer(comm, model.named_parameters(), bucket_bytes=64,
                             last_bucket_bytes=None) as reducer:
            used = [b for b in reducer.buckets if b.params[0] is model.used.bias
                    or b.params[0] is model.used.weight]
            reducer.arm(last=True)
            model(torch.ones(2, 4)).sum().backward()
            for bucket in used:   # reduced beside "compute": synchronize has not begun
                bucket.done.wait()
            beside = list(seen)
            reducer.synchronize()
    finally:
        del comm.allreduce_flat_
    assert beside and all(ceiling == PATIENT_WAIT_S for _, ceiling in beside)
    drained = seen[len(beside):]
    assert drained and all(ceiling == URGENT_WAIT_S for _, ceiling in drained)
    assert URGENT_WAIT_S < PATIENT_WAIT_S
    assert wait_ceiling_s() == URGENT_WAIT_S  # a thread nobody marked: always urgent


@contextlib.contextmanager
def small_buckets_after_backward(comm, model, x, allreduce):
    """A reducer of 64-byte buckets over ``model``, ``comm.allreduce_flat_`` replaced by
    ``allreduce``, armed and after one backward of ``x``."""
    comm.allreduce_flat_ = allreduce
    try:
        with GradientReducer(comm, model.named_parameters(), bucket_bytes=64,
                             last_bucket_bytes=None) as reducer:
            reducer.arm(last=True)
            model(x).sum().backward()
            yield reducer
    finally:
        del comm.allreduce_flat_


def test_buckets_come_back_one_at_a_time_in_order_while_later_ones_travel(comm):
    """reduced_buckets: the caller holds bucket k (to update it) while bucket k+1 is still on
    the wire, and each bucket's gradients are final when it comes back."""
    torch.manual_seed(2)
    model = TwoHeads()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    expected = {p: p.grad.clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    gate = threading.Event()   # the second bucket's allreduce waits for the caller's first
    calls = []
    original = comm.allreduce_flat_

    def held(buf, average=True):
        calls.append(buf.numel())
        if len(calls) == 2:
            assert gate.wait(30)
        return original(buf, average=average)

    with small_buckets_after_backward(comm, model, x, held) as reducer:
        assert len(reducer.buckets) >= 2
        came = []
        for params in reducer.reduced_buckets():
            if not came:
                assert not reducer.buckets[1].done.is_set()  # still travelling
                gate.set()
            came.append(params)
            for p in params:
                assert torch.equal(p.grad, expected[p])
        assert came == [bucket.params for bucket in reducer.buckets]


def test_a_caller_that_stops_early_leaves_no_bucket_in_flight(comm):
    torch.manual_seed(3)
    model = TwoHeads()
    x = torch.randn(5, 4)
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=64,
                         last_bucket_bytes=None) as reducer:
        reducer.arm(last=True)
        model(x).sum().backward()
        buckets = reducer.reduced_buckets()
        next(buckets)
        buckets.close()   # e.g. the update of the first bucket raised
        assert all(not b.done.is_set() and not b.filled for b in reducer.buckets)
        model.zero_grad(set_to_none=True)
        reducer.arm(last=True)
        model(x).sum().backward()
        reducer.synchronize()   # the next step reduces every bucket again
        assert all(p.grad is not None for p in model.parameters())


def test_wire_dtype_sets_the_bucket_dtype():
    buckets = layout_buckets([("w", torch.zeros(4))], 64, wire_dtype=torch.bfloat16)
    assert buckets[0].dtype == torch.bfloat16


def test_synchronize_leaves_the_gradients_of_one_rank_unchanged(comm):
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=64) as reducer:
        assert len(reducer.buckets) > 1
        reducer.arm(last=True)
        model(x).sum().backward()
        reducer.synchronize()
        assert reducer.comm_wait_s >= 0.0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n


def test_unused_parameters_do_not_hang_and_get_zero_gradients(comm):
    model = TwoHeads()
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=1 << 20) as reducer:
        reducer.arm(last=True)
        model(torch.randn(2, 4), use_b=False).sum().backward()
        reducer.synchronize()
    assert torch.count_nonzero(model.b.weight.grad) == 0
    assert torch.count_nonzero(model.a.weight.grad) > 0


def test_accumulation_reduces_the_sum_of_micro_batches_once(comm):
    torch.manual_seed(1)
    model = TwoHeads()
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    sum(model(x).sum() for x in xs).backward()
    expected = model.trunk.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    calls = []
    original = comm.allreduce_flat_
    comm.allreduce_flat_ = lambda buf, average=True: (calls.append(buf.numel()),
                                                       original(buf, average))
    try:
        with GradientReducer(comm, model.named_parameters(), bucket_bytes=1 << 20) as reducer:
            for i, x in enumerate(xs):
                reducer.arm(last=(i == len(xs) - 1))
                model(x).sum().backward()
            reducer.synchronize()
    finally:
        del comm.allreduce_flat_
    assert len(calls) == 1  # one bucket, reduced once: after the last micro-batch
    assert torch.allclose(model.trunk.weight.grad, expected)


def test_disabled_reducer_never_communicates(comm):
    model = TwoHeads()
    calls = []
    comm.allreduce_flat_ = lambda buf, average=True: calls.append(buf)
    try:
        with GradientReducer(comm, model.named_parameters(), 64, enabled=False) as reducer:
            reducer.arm(last=True)
            model(torch.randn(2, 4)).sum().backward()
            reducer.synchronize()
    finally:
        del comm.allreduce_flat_
    assert calls == [] and reducer.comm_wait_s == 0.0
    assert model.a.weight.grad is not None


def test_communication_error_is_raised_in_synchronize(comm):
    model = TwoHeads()

    def broken(buf, average=True):
        raise RuntimeError("link down")

    comm.allreduce_flat_ = broken
    try:
        with GradientReducer(comm, model.named_parameters(), 1 << 20) as reducer:
            reducer.arm(last=True)
            model(torch.randn(2, 4)).sum().backward()
            with pytest.raises(RuntimeError, match="link down"):
                reducer.synchronize()
    finally:
        del comm.allreduce_flat_


class SlowAfterFirst(queue.Queue):
    """The communication thread's queue, handing out every item after the first 0.2 s late:
    the main thread then acts on a failure before the thread has reached the next bucket."""

    def get(self, *args, **kwargs):
        item = super().get(*args, **kwargs)
        self.handed = getattr(self, "handed", 0) + 1
        if self.handed > 1 and item is not None:
            time.sleep(0.2)
        return item


def test_a_failed_bucket_skips_the_rest_of_the_step_before_it_raises(comm, monkeypatch):
    """After one bucket's collective fails, the thread skips every later bucket of that step
    (a collective started on this rank alone would hang its peers) until the error is raised
    here; raising clears it, so it must come after the skips."""
    import hpcdl.comm.reducer as reducer_module

    monkeypatch.setattr(reducer_module, "queue", SimpleNamespace(Queue=SlowAfterFirst))
    model = TwoHeads()
    calls = []

    def broken(buf, average=True):
        calls.append(buf.numel())
        raise RuntimeError("link down")

    with small_buckets_after_backward(comm, model, torch.randn(2, 4), broken) as reducer:
        assert len(reducer.buckets) >= 3
        with pytest.raises(RuntimeError, match="link down"):
            reducer.synchronize()
        assert len(calls) == 1


def test_model_without_trainable_parameters_is_an_error(comm):
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter"):
        GradientReducer(comm, frozen.named_parameters(), 64)


@pytest.mark.parametrize("model_name, on_meta, bucket_mb, wire_dtype", [
    ("resnet_small", False, 0.1, None), ("resnet_small", False, 0.05, torch.bfloat16),
    ("alexnet_bn", True, 25, None), ("alexnet_bn", True, 4, torch.bfloat16)])
def test_the_planner_costs_the_buckets_the_reducer_fills(comm, tmp_path, model_name, on_meta,
                                                         bucket_mb, wire_dtype):
    """hpcdl plan lays out the gradient of a model's parameter list as the reducer lays out
    the model's real parameters: the same boundaries, hence the same bucket bytes."""
    from hpcdl.buckets import bucket_bytes
    from hpcdl.models import create_model
    from hpcdl.plan.model import gradient_buckets
    from hpcdl.plan.workload import workload

    with torch.device("meta" if on_meta else "cpu"):
        model = create_model(model_name)
    reducer = GradientReducer(comm, model.named_parameters(), bucket_bytes(bucket_mb),
                              wire_dtype=wire_dtype, enabled=not on_meta)
    try:
        wire = 2 if wire_dtype is torch.bfloat16 else 4
        filled = [b.numel * wire for b in reducer.buckets]
    finally:
        reducer.close()
    size = 224 if on_meta else 32   # (AlexNet's pooling needs an image of its size)
    work = workload(model_name, size, cache_path=str(tmp_path / "layers.json"))
    assert len(filled) > 2
    assert gradient_buckets(work, wire, bucket_mb) == filled
