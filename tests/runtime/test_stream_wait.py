"""The adaptive wait on MLX's CPU stream thread (cpp/stream_wait.h): while calls come back to
back the stream thread lingers between calls and the caller spins for small results; with gaps
of milliseconds nothing lingers or spins, and a small graph finds the delegate stream's thread
parked (asleep in a task of ours: its tasks queue behind it and one release wakes it), or, with
the park off, is gated (the sleeping stream thread is woken once, for a gate task, rather than
once per task). Results must not depend on which path a call took: every
call here is checked against eager PyTorch (or a single-threaded run) through the stock
`executorch.runtime`."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower


class Small(torch.nn.Module):
    """A few nodes: the graph a back-to-back caller holds the stream thread awake for."""

    def forward(self, x, y):
        return (x + y) * y, (x * 2.0).t()  # the transpose comes back strided: a follow-up copy


class IntDiv(torch.nn.Module):
    """Integer division: the runtime evaluates the divisor mid-graph to refuse a zero."""

    def forward(self, a, b):
        return torch.div(a, b, rounding_mode="floor")


def _inputs(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def small():
    """One lowering for the module; a fresh method per test (its own compiled-graph state)."""
    lowered = lower(Small(), _inputs(1)[0])
    return lowered


def _check(method, x, y):
    out = method.execute([x, y])
    torch.testing.assert_close(out[0], (x + y) * y, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], (x * 2.0).t())


def _stats() -> dict[str, int]:
    return _runtime.stream_wait_stats()


def _on_cpu_stream() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def test_many_back_to_back_calls_linger_and_stay_exact(small):
    method = small.method()
    xs = _inputs(16, seed=1)
    # The check between calls takes tens of µs, and far more on a loaded or instrumented (sanitizer)
    # build: a bound of 20 ms keeps these calls "back to back" on any machine.
    was = _runtime.stream_linger()
    _runtime.set_stream_linger(20_000)
    try:
        before = _stats()
        # Blocks of 600 calls, up to three: on a machine whose other process takes both cores (a
        # parallel test run), one block can go without the linger ever holding a result.
        for _block in range(3):
            for i in range(600):
                _check(method, *xs[i % len(xs)])
            ran = {k: v - before[k] for k, v in _stats().items()}
            if not _on_cpu_stream() or (ran["held"] > 0 and ran["spins"] > 0):
                break
    finally:
        _runtime.set_stream_linger(was)
    if _on_cpu_stream():
        # Back-to-back calls come microseconds apart: the wait took the lingering path.
        assert ran["calls"] >= 600
        assert ran["lingers"] > 0 and ran["held"] > 0 and ran["spins"] > 0, ran
        # A linger that starts after the next evaluation began (its thread descheduled after the result, or a
        # follow-up copy right behind the main result) ends at once rather than spin its time out in front of
        # that evaluation's tasks: 15 % of these calls did so before.
        assert ran["linger_timeouts"] < ran["calls"] // 10, ran
        # The next call is expected within microseconds: the kernels' helpers keep spinning for it.
        assert ran["parks"] < ran["calls"] // 10, ran
    else:  # a GPU stream: MLX's own waiting, untouched
        assert ran["calls"] == 0


class _Switches:
    """Sets the wait's switches to known values (whatever the environment says) and restores them."""

    def __init__(self, linger: int = 200, gate: int = 1, park: bool = True) -> None:
        self.want = (linger, gate, park)

    def __enter__(self) -> None:
        self.was = (_runtime.stream_linger(), _runtime.stream_gate(), _runtime.stream_park())
        self._set(self.want)

    def __exit__(self, *exc: object) -> None:
        self._set(self.was)

    @staticmethod
    def _set(v: tuple[int, int, bool]) -> None:
        _runtime.set_stream_linger(v[0])
        _runtime.set_stream_gate(v[1])
        _runtime.set_stream_park(v[2])


@pytest.mark.parametrize("park", [True, False])
def test_calls_with_gaps_neither_linger_nor_spin(small, park):
    """At a call every few ms (an app polling a model) nothing spins: no linger keeps the stream
    thread awake after a call, and the caller sleeps for its result. With the park (default) each
    call finds the delegate stream's thread parked and releases it once its tasks are queued; with
    it off, each call is gated (the default gate mode)."""
    method = small.method()
    xs = _inputs(4, seed=2)
    with _Switches(park=park):
        for x, y in xs[:2]:  # the first two gaps are measured here
            time.sleep(0.003)
            _check(method, x, y)
        before = _stats()
        for i in range(12):
            time.sleep(0.003)
            _check(method, *xs[i % len(xs)])
        ran = {k: v - before[k] for k, v in _stats().items()}
    assert ran["lingers"] == 0 and ran["held"] == 0 and ran["spins"] == 0, ran
    if _on_cpu_stream():
        if park:
            # Each call's tasks queued behind the park the previous call left, and it left one.
            assert ran["unparked"] >= 12 and ran["stream_parks"] >= 12, ran
            assert ran["gates"] == 0 and ran["park_timeouts"] == 0, ran
        else:
            # Each call's small graph woke the sleeping stream thread through a gate.
            assert ran["gates"] >= 12 and ran["unparked"] == 0 and ran["stream_parks"] == 0, ran
        # ... and each call sends the kernels' helper threads to sleep as it ends, rather than
        # leaving them spinning for a next product that is milliseconds away.
        assert ran["parks"] >= 12, ran


def test_parked_stream_never_holds_up_mlx_work_on_the_calling_thread(small):
    """MLX Python on the caller's own thread between parked calls runs on its own default
    stream, not behind the park: no park has to time out for it, and the results stay exact."""
    import mlx.core as mx

    method = small.method()
    xs = _inputs(4, seed=9)
    with _Switches():
        before = _stats()
        for i in range(20):
            x, y = xs[i % len(xs)]
            time.sleep(0.002)
            _check(method, x, y)
            a = mx.array(x.numpy()) * 3.0
            mx.eval(a)
            assert_close([torch.from_numpy(np.array(a))], x * 3.0, 1e-6, 1e-6)
        ran = {k: v - before[k] for k, v in _stats().items()}
    if _on_cpu_stream():
        assert ran["unparked"] >= 15 and ran["park_timeouts"] == 0, ran


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_gated_calls_stay_exact_in_every_gate_mode(small, mode):
    """Gate off, gate alone, gate with the caller spinning (the park off): the same results."""
    method = small.method()
    xs = _inputs(4, seed=7)
    with _Switches(gate=mode, park=False):
        before = _stats()["gates"]
        for i in range(12):
            time.sleep(0.002)
            _check(method, *xs[i % len(xs)])
        gated = _stats()["gates"] - before
    if mode == 0:
        assert gated == 0
    elif _on_cpu_stream():
        assert gated >= 12


@pytest.mark.parametrize("park", [True, False])
def test_gated_calls_from_two_threads_while_mlx_evaluates_elsewhere(small, park):
    """Two threads calling with gaps (each call parked or gated: own methods and a shared one, whose
    compiled graph runs on the stream of the thread that traced it) while a third evaluates MLX
    Python work: no deadlock, every result exact."""
    import mlx.core as mx

    own = [small.method(), small.method()]
    shared = small.method()
    xs = _inputs(8, seed=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def call(t: int) -> None:
        try:
            for i in range(25):
                x, y = xs[(i + t) % len(xs)]
                time.sleep(0.001)
                _check(own[t], x, y)
                _check(shared, x, y)
        except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
            errors.append(e)

    def mlx_work() -> None:
        try:
            x = xs[0][0]
            while not stop.is_set():
                a = mx.array(x.numpy()) * 3.0 + 1.0
                mx.eval(a)
                assert_close([torch.from_numpy(np.array(a))], x * 3.0 + 1.0, 1e-6, 1e-6)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(t,)) for t in range(2)]
    other = threading.Thread(target=mlx_work)
    with _Switches(park=park):
        other.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        stop.set()
        other.join(timeout=120)
    assert not any(th.is_alive() for th in [*threads, other]), "a gated call or MLX's evaluation hung"
    assert not errors, errors[0]


def test_bursts_and_gaps_alternate(small):
    method = small.method()
    xs = _inputs(8, seed=3)
    for burst in range(4):
        for i in range(40):
            _check(method, *xs[(i + burst) % len(xs)])
        time.sleep(0.002 * (burst + 1))  # longer than any linger: the next burst starts cold


def test_wait_off_gives_the_same_results(small):
    method = small.method()
    xs = _inputs(4, seed=4)
    was = _runtime.stream_linger()
    _runtime.set_stream_linger(0)
    try:
        before = _stats()["calls"]
        for i in range(50):
            _check(method, *xs[i % len(xs)])
        assert _stats()["calls"] == before  # plain mx::eval, outside the adaptive wait
    finally:
        _runtime.set_stream_linger(was)
    for i in range(50):
        _check(method, *xs[i % len(xs)])


class Head(torch.nn.Module):
    """A classifier head at one row: few nodes, but a product long enough (2.6 M multiply-adds, 10 MB of
    weights) for the kernel pool to split and for the call to outlast the serving threshold."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(1280, 2048)

    def forward(self, x):
        return torch.nn.functional.hardswish(self.fc(x))


@pytest.mark.parametrize("gap", [0.0, 0.002])
def test_waiting_caller_serves_the_pool_and_results_do_not_change(gap):
    head = Head().eval()
    xs = [torch.randn(1, 1280, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    method = lower(head, (xs[0],)).method()
    was = _runtime.caller_serve()
    outs: dict[bool, list[torch.Tensor]] = {}
    try:
        for serve in (True, False):
            _runtime.set_caller_serve(serve)
            before = _stats()
            outs[serve] = []
            for i in range(120):
                x = xs[i % len(xs)]
                out = method.execute([x])[0]
                with torch.no_grad():
                    torch.testing.assert_close(out, head(x), rtol=1e-5, atol=1e-5)
                outs[serve].append(out.clone())
                if gap:
                    time.sleep(gap)
            ran = {k: v - before[k] for k, v in _stats().items()}
            # A result always ends the caller's service (not its 100 ms time bound).
            assert ran["serve_timeouts"] == 0, ran
            if not serve:
                assert ran["serves"] == 0, ran
            elif _on_cpu_stream() and len(os.sched_getaffinity(0)) > 1:  # the pool has a helper
                assert ran["serves"] >= 100, ran
    finally:
        _runtime.set_caller_serve(was)
    # Each output row is one thread's dot product whoever runs it: bit for bit the same.
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


def _in_two_threads(work) -> None:
    """Runs work(0) and work(1) on two threads at once; the first error is raised here."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def test_two_threads_back_to_back(small):
    """Each Python thread has its own MLX stream (and stream thread): two threads calling back
    to back, one method each and one shared, linger independently and stay exact."""
    own = [small.method(), small.method()]
    shared = small.method()
    xs = _inputs(8, seed=5)

    def work(t: int) -> None:
        for i in range(300):
            x, y = xs[(i + t) % len(xs)]
            _check(own[t], x, y)
            _check(shared, x, y)

    _in_two_threads(work)


def test_two_threads_serving_the_pool_at_once():
    """Two callers of a served graph, each on its own stream: both serve the one kernel pool (a job
    published by one stream's thread may be helped by the other caller) and every result stays exact."""
    head = Head().eval()
    lowered = lower(head, (torch.randn(1, 1280),))
    methods = [lowered.method(), lowered.method()]
    xs = [torch.randn(1, 1280, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    with torch.no_grad():
        refs = [head(x) for x in xs]
    before = _stats()

    def work(t: int) -> None:
        for i in range(150):
            k = (i + t) % len(xs)
            torch.testing.assert_close(methods[t].execute([xs[k]])[0], refs[k], rtol=1e-5, atol=1e-5)

    _in_two_threads(work)
    ran = {k: v - before[k] for k, v in _stats().items()}
    assert ran["serve_timeouts"] == 0, ran
    if _on_cpu_stream() and len(os.sched_getaffinity(0)) > 1:
        assert ran["serves"] > 0, ran


def test_mlx_work_between_calls_is_not_held_up(small):
    """MLX work of the caller's own (same thread, same stream) queued behind a linger still
    runs: the linger is bounded, so a plain mx.eval right after a call completes correctly."""
    import mlx.core as mx

    method = small.method()
    xs = _inputs(4, seed=6)
    for i in range(100):
        x, y = xs[i % len(xs)]
        _check(method, x, y)
        a = mx.array(x.numpy()) * 3.0
        mx.eval(a)
        assert_close([torch.from_numpy(np.array(a))], x * 3.0, 1e-6, 1e-6)


@pytest.mark.parametrize("gap", [0.0, 0.002])
def test_errors_mid_graph_and_bad_inputs_between_calls(gap):
    """The mid-graph evaluation that refuses an integer zero divisor goes ahead of a linger (back
    to back) or through a gate (with gaps); a refused call (zero divisor, wrong dtype) leaves the
    next calls exact."""
    a = torch.tensor([7, -7, 9, 10], dtype=torch.int32)
    b = torch.tensor([2, 2, -4, 3], dtype=torch.int32)
    method = lower(IntDiv(), (a, b)).method()
    expected = torch.div(a, b, rounding_mode="floor")
    zero = torch.tensor([2, 0, 1, 1], dtype=torch.int32)
    for i in range(60 if gap == 0 else 24):
        time.sleep(gap)
        assert torch.equal(method.execute([a, b])[0], expected)
        if i % 20 == 10:
            with pytest.raises(Exception):
                method.execute([a, zero])
            assert "division" in _runtime.last_error().lower()
            with pytest.raises(Exception):
                method.execute([a.float(), b])
    assert torch.equal(method.execute([a, b])[0], expected)
