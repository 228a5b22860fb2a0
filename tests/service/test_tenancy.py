"""Tenants sharing the service: fair turns in the queues, per-token queue shares, judging that is
counted, dropped or stopped when its caller goes. Every ordering is checked by the order of events
(a gated worker, recorded calls), never by a time.

The expected orders are written out by hand from RFC 8290's two lists with a quantum of one item:
a tenant with no lane gets one in the new list, served before the old; a lane that had its turn goes
to the back of the old list, even empty; an empty old lane leaves when its turn comes round.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from moegrad import DeadlineExceeded, DeviceBusy
from moegrad_service.api.auth import Authenticator
from moegrad_service.dataplane import ClientDisconnected, Comparison
from moegrad_service.engine import FairQueue, JudgePool, ReferenceBackend, StreamPool
from moegrad_service.settings import Settings
from support.dataplane_cases import doc_call, open_dataplane
from support.docexample import DOC_RESULT_BITS, example_document
from support.servicekit import Recorder, gauge, grad_x_of, pack, post

# --- the fair queue ----------------------------------------------------------------------------


def drain(queue: FairQueue) -> list:
    return [queue.get() for _ in range(len(queue))]


def test_the_queue_takes_each_tenant_in_turn():
    queue = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.put(item, "A")
    queue.put("b1", "B")
    queue.put("c1", "C")
    queue.put("a4", "A")
    assert drain(queue) == ["a1", "b1", "c1", "a2", "a3", "a4"]


def test_a_tenant_whose_lane_emptied_keeps_its_turn_behind_new_ones():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("b1", "B")
    assert queue.get() == "a1"  # A's lane, empty, goes to the old list
    queue.put("a2", "A")  # ... where a2 waits, behind B's new lane
    queue.put("b2", "B")
    assert drain(queue) == ["b1", "a2", "b2"]


def test_a_new_tenant_goes_ahead_of_a_backlog_once_a_round():
    queue = FairQueue()
    for item in ("a1", "a2", "a3", "a4"):
        queue.put(item, "A")
    assert queue.get() == "a1"  # A's backlog is in the old list now
    queue.put("b1", "B")
    assert queue.get() == "b1"  # B had no lane: new, ahead of A's backlog
    queue.put("b2", "B")  # B's lane, empty, went to the back of the old list: b2 waits its turn there
    assert drain(queue) == ["a2", "b2", "a3", "a4"]


def test_an_empty_lane_leaves_when_its_turn_comes_round():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("b1", "B")
    queue.put("b2", "B")
    assert [queue.get(), queue.get()] == ["a1", "b1"]  # both lanes in the old list, A's empty
    assert queue.tenants() == 1
    assert queue.get() == "b2"  # A's turn came round empty: A left, B's next is taken
    queue.put("a2", "A")  # A has no lane: a new one, ahead of B's (empty, old)
    queue.put("b3", "B")
    assert drain(queue) == ["a2", "b3"]


def test_one_tenant_alone_is_first_in_first_out():
    queue = FairQueue()
    for item in range(5):
        queue.put(item)
    assert drain(queue) == [0, 1, 2, 3, 4]


def test_an_express_worker_takes_the_first_express_item_in_turn_and_never_out_of_a_lanes_order():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("a2-small", "A", express=True)  # behind A's own a1: not A's turn for it yet
    queue.put("b1", "B")
    queue.put("c1-small", "C", express=True)
    queue.put("d1-small", "D", express=True)
    assert queue.get(express=True) == "c1-small"  # A's and B's lanes start with work not express
    assert queue.get() == "a1"  # C's lane had its turn: the next new lane is A's
    assert queue.get(express=True) == "d1-small"  # D's new lane before A's old one
    assert queue.get(express=True) == "a2-small"
    assert drain(queue) == ["b1"]


def waiting_express_worker(queue: FairQueue) -> tuple[threading.Thread, list]:
    """A thread taking one item with ``queue.get(express=True)`` into the list returned, checked to
    be still waiting (nothing there for it yet)."""
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append(queue.get(express=True)), daemon=True)
    worker.start()
    worker.join(0.2)
    assert worker.is_alive() and not taken
    return worker, taken


def test_an_express_worker_waits_for_express_work():
    queue = FairQueue()
    queue.put("a1", "A")
    worker, taken = waiting_express_worker(queue)  # a1 is not for it
    queue.put("b1-small", "B", express=True)
    worker.join(10)
    assert taken == ["b1-small"] and drain(queue) == ["a1"]


def test_an_express_worker_is_woken_when_express_work_comes_first_in_its_lane():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("a2-small", "A", express=True)  # express, but behind a1
    worker, taken = waiting_express_worker(queue)
    assert queue.get() == "a1"  # a2-small is first in A's lane now
    worker.join(10)
    assert taken == ["a2-small"] and len(queue) == 0


def test_an_express_worker_is_woken_when_work_given_up_on_ahead_of_express_work_is_taken_out():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("a2-small", "A", express=True)  # express, but behind a1
    worker, taken = waiting_express_worker(queue)
    assert queue.remove("a1", "A")  # its caller gave up on it: a2-small is first in A's lane now
    worker.join(10)
    assert taken == ["a2-small"] and len(queue) == 0
    assert not queue.remove("a1", "A")  # taken out once


def test_a_new_lane_emptied_by_removal_leaves_the_new_list():
    queue = FairQueue()
    queue.put("a1", "A")
    queue.put("b1", "B")
    assert queue.remove("a1", "A") and queue.tenants() == 1
    queue.put("c1", "C")
    assert drain(queue) == ["b1", "c1"]
    queue.put("a2", "A")  # A has no lane: a new one
    assert drain(queue) == ["a2"]


# --- the stream pool ---------------------------------------------------------------------------


def call_of(hidden: int):
    return doc_call(grad_expanded_x=np.ones((4, hidden), np.float32))


@pytest.mark.asyncio
async def test_the_pool_runs_a_new_tenants_call_before_a_floods_backlog():
    recorder = Recorder()
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=recorder), streams=1, max_queue=8)
    await pool.start()
    try:
        first = asyncio.create_task(pool.run(call_of(1), timeout_s=30, tenant="A"))
        await asyncio.to_thread(recorder.first.wait, 10)
        flood = [asyncio.create_task(pool.run(call_of(h), timeout_s=30, tenant="A")) for h in (2, 3, 4)]
        await asyncio.sleep(0)
        small = asyncio.create_task(pool.run(call_of(10), timeout_s=30, tenant="B"))
        await asyncio.sleep(0)
        assert (pool.queue_depth, pool.queued_by("A"), pool.queued_by("B")) == (4, 3, 1)
        recorder.release.set()
        await asyncio.gather(first, *flood, small)
    finally:
        recorder.release.set()
        await pool.close(grace_s=5)
    # A's call running (its lane had its turn), A's three queued, then B's new lane: B runs next
    assert recorder.order == [1, 10, 2, 3, 4]


@pytest.mark.asyncio
async def test_each_token_has_its_own_share_of_the_queue():
    recorder = Recorder()
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=recorder), streams=1, max_queue=2)
    await pool.start()
    try:
        running = asyncio.create_task(pool.run(call_of(1), timeout_s=30, tenant="A"))
        await asyncio.to_thread(recorder.first.wait, 10)
        queued = [asyncio.create_task(pool.run(call_of(2), timeout_s=30, tenant="A")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(DeviceBusy, match=r"queue is full \(2 calls waiting for this token\)"):
            await pool.run(call_of(3), timeout_s=30, tenant="A")
        other = asyncio.create_task(pool.run(call_of(4), timeout_s=30, tenant="B"))  # B's share is its own
        await asyncio.sleep(0)
        assert pool.queued_by("B") == 1
        recorder.release.set()
        await asyncio.gather(running, *queued, other)
    finally:
        recorder.release.set()
        await pool.close(grace_s=5)


class HoldingLarge:
    """A fault hook that holds every call of H >= ``large`` (or of grad_expanded_x with ``rows`` rows
    or more) until released; records every call's H when it starts, and a held call's H when it goes on."""

    def __init__(self, large: int, rows: int | None = None) -> None:
        self.large = large
        self.rows = rows
        self.release = threading.Event()
        self.started: list[int] = []
        self.first = threading.Event()  # set when the first call starts
        self.let_go: list[int] = []

    def __call__(self, call, timeout_s) -> None:
        self.started.append(call.hidden_size)
        self.first.set()
        if call.hidden_size >= self.large or (self.rows is not None and call.grad_expanded_x.shape[0] >= self.rows):
            self.release.wait(30)
            self.let_go.append(call.hidden_size)


@pytest.mark.asyncio
async def test_a_small_call_runs_on_the_express_worker_while_large_ones_hold_every_worker():
    hook = HoldingLarge(large=100)
    # call_of(h): N*K = 4 slots of H = h, so 4*h adds; 400 adds and more are not express
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=hook), streams=1, max_queue=8, express_max_adds=399)
    await pool.start()
    try:
        assert pool.capacity == 1  # the express worker is not counted
        large = [asyncio.create_task(pool.run(call_of(h), timeout_s=30, tenant="A")) for h in (100, 101)]
        own_small = asyncio.create_task(pool.run(call_of(5), timeout_s=30, tenant="A"))  # behind A's 101
        await asyncio.to_thread(hook.first.wait, 10)
        grad_x, _ = await asyncio.wait_for(pool.run(call_of(10), timeout_s=30, tenant="B"), 10)
        assert grad_x.shape == (2, 10)
        assert hook.started == [100, 10] and hook.let_go == []  # B's call ran while A's were held
        assert not own_small.done()  # A's small call keeps its place in A's lane
        hook.release.set()
        await asyncio.gather(*large, own_small)
    finally:
        hook.release.set()
        await pool.close(grace_s=5)
    assert sorted(hook.started) == [5, 10, 100, 101] and hook.started.index(101) < hook.started.index(5)


@pytest.mark.asyncio
async def test_without_an_express_worker_a_small_call_waits_for_a_worker():
    hook = HoldingLarge(large=100)
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=hook), streams=1, max_queue=8)  # express_max_adds 0
    await pool.start()
    try:
        large = asyncio.create_task(pool.run(call_of(100), timeout_s=30, tenant="A"))
        await asyncio.to_thread(hook.first.wait, 10)
        small = asyncio.create_task(pool.run(call_of(10), timeout_s=30, tenant="B"))
        await asyncio.sleep(0.2)
        assert not small.done() and hook.started == [100]
        hook.release.set()
        await asyncio.gather(large, small)
    finally:
        hook.release.set()
        await pool.close(grace_s=5)
    assert hook.started == [100, 10]


@pytest.mark.asyncio
@pytest.mark.parametrize("given_up", ["deadline", "cancelled"])
async def test_a_small_call_behind_a_call_given_up_on_while_queued_runs_on_the_express_worker(given_up):
    """A's large call is given up on while it waits (its deadline, or its caller gone); A's next
    call, small, is then first in A's lane and runs on the express worker while B's large call holds
    the only stream worker."""
    hook = HoldingLarge(large=100)
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=hook), streams=1, max_queue=8, express_max_adds=399)
    await pool.start()
    try:
        held = asyncio.create_task(pool.run(call_of(100), timeout_s=30, tenant="B"))
        await asyncio.to_thread(hook.first.wait, 10)
        if given_up == "deadline":
            with pytest.raises(DeadlineExceeded, match="while the call was queued"):
                await pool.run(call_of(101), timeout_s=0.05, tenant="A")
        else:
            gone = asyncio.create_task(pool.run(call_of(101), timeout_s=30, tenant="A"))
            await asyncio.sleep(0)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
        assert pool.queue_depth == 0
        grad_x, _ = await asyncio.wait_for(pool.run(call_of(10), timeout_s=30, tenant="A"), 10)
        assert grad_x.shape == (2, 10)
        assert hook.started == [100, 10] and hook.let_go == []  # answered while B's call was held
        hook.release.set()
        await held
    finally:
        hook.release.set()
        await pool.close(grace_s=5)
    assert hook.started == [100, 10]  # A's given-up call never ran


@pytest.mark.asyncio
async def test_a_call_with_few_adds_but_a_large_grad_expanded_x_is_not_express():
    """Active mode: 4 slots x H = 7 (28 adds), but grad_expanded_x has 1000 rows (7000 elements, all
    copied to the device): not small. It waits for the stream worker; C's small call runs on the
    express worker meanwhile."""
    hook = HoldingLarge(large=100, rows=1000)
    pool = StreamPool(ReferenceBackend(warm_up=False, fault_hook=hook), streams=1, max_queue=8, express_max_adds=399)
    await pool.start()
    try:
        held = asyncio.create_task(pool.run(call_of(100), timeout_s=30, tenant="B"))
        await asyncio.to_thread(hook.first.wait, 10)
        fat = doc_call(grad_expanded_x=np.ones((1000, 7), np.float32), active_num=1000)
        waiting = asyncio.create_task(pool.run(fat, timeout_s=30, tenant="A"))
        await asyncio.sleep(0)
        grad_x, _ = await asyncio.wait_for(pool.run(call_of(10), timeout_s=30, tenant="C"), 10)
        assert grad_x.shape == (2, 10)
        assert hook.started == [100, 10] and not waiting.done()
        hook.release.set()
        await asyncio.gather(held, waiting)
    finally:
        hook.release.set()
        await pool.close(grace_s=5)
    assert hook.started == [100, 10, 7]


def test_by_default_the_service_answers_a_small_call_while_a_large_one_holds_its_only_stream(serve):
    """With the default ``express_max_adds`` (2^20 adds): a call of 4 slots x H = 2^18 + 1 (just over
    it) holds the one stream worker; the documentation's example (8 adds) is answered meanwhile."""
    hook = HoldingLarge(large=1 << 18)
    hidden = (1 << 18) + 1
    large = example_document(grad_expanded_x={"dtype": "float32", "shape": [4, hidden],
                                              "data": np.ones((4, hidden), np.float32).tobytes()})
    with serve(backend=ReferenceBackend(warm_up=False, fault_hook=hook), streams=1) as client, \
            ThreadPoolExecutor(1) as threads:
        held = threads.submit(post, client, large)
        hook.first.wait(30)
        small = post(client, example_document())
        assert small.status_code == 200, small.text
        assert grad_x_of(small).view(np.uint32).tolist() == DOC_RESULT_BITS.tolist()
        assert hook.started == [hidden, 2] and hook.let_go == []  # answered while the large call was held
        hook.release.set()
        assert held.result(timeout=30).status_code == 200


# --- the judges --------------------------------------------------------------------------------


class Blocking:
    """Judging work that records its start and waits until released or stopped; ``stopped`` says which."""

    def __init__(self, name: str, log: list[str], release: threading.Event) -> None:
        self.name, self.log, self.release = name, log, release
        self.started = threading.Event()
        self.stopped = threading.Event()

    def __call__(self, stop: threading.Event) -> str:
        self.log.append(self.name)
        self.started.set()
        while not self.release.is_set():
            if stop.wait(0.01):
                self.stopped.set()
                raise DeadlineExceeded("stopped")
        return self.name


@pytest.mark.asyncio
async def test_judging_takes_the_tenants_in_turn():
    judges, log, release = JudgePool(1), [], threading.Event()
    try:
        works = {name: Blocking(name, log, release) for name in ("a1", "a2", "a3", "b1")}
        first = asyncio.create_task(judges.run(works["a1"], timeout_s=30, tenant="A"))
        await asyncio.to_thread(works["a1"].started.wait, 10)
        rest = [asyncio.create_task(judges.run(works[n], timeout_s=30, tenant=t))
                for n, t in (("a2", "A"), ("a3", "A"), ("b1", "B"))]
        await asyncio.sleep(0)
        assert (judges.queue_depth, judges.in_flight) == (3, 1)
        release.set()
        assert await asyncio.gather(first, *rest) == ["a1", "a2", "a3", "b1"]
    finally:
        release.set()
        await judges.close()
    assert log == ["a1", "b1", "a2", "a3"]  # B's new lane before A's backlog


@pytest.mark.asyncio
async def test_judging_whose_caller_went_is_dropped_while_queued_and_stopped_while_running():
    judges, log, release = JudgePool(1), [], threading.Event()
    try:
        running, waiting = Blocking("running", log, release), Blocking("waiting", log, release)
        first = asyncio.create_task(judges.run(running, timeout_s=30))
        await asyncio.to_thread(running.started.wait, 10)
        second = asyncio.create_task(judges.run(waiting, timeout_s=30))
        await asyncio.sleep(0)
        second.cancel()
        first.cancel()
        for task in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await asyncio.to_thread(running.stopped.wait, 10)
        assert judges.queue_depth == 0
        # the next judging runs, and the dropped one never did
        assert await judges.run(lambda stop: "next", timeout_s=30) == "next"
    finally:
        release.set()
        await judges.close()
    assert log == ["running"]
    assert judges.in_flight == 0


@pytest.mark.asyncio
async def test_judging_past_its_deadline_is_stopped_and_answers_504():
    judges, log, release = JudgePool(1), [], threading.Event()
    try:
        work = Blocking("slow", log, release)
        with pytest.raises(DeadlineExceeded, match="while it was judged"):
            await judges.run(work, timeout_s=0.2)
        assert await asyncio.to_thread(work.stopped.wait, 10)
    finally:
        release.set()
        await judges.close()


@pytest.mark.asyncio
async def test_judging_still_waiting_at_shutdown_is_answered_503():
    judges, log, release = JudgePool(1), [], threading.Event()
    running = Blocking("running", log, release)
    first = asyncio.create_task(judges.run(running, timeout_s=30))
    await asyncio.to_thread(running.started.wait, 10)
    waiting = asyncio.create_task(judges.run(Blocking("waiting", log, release), timeout_s=30))
    await asyncio.sleep(0)
    await judges.close(timeout_s=0.1)  # the running one holds its thread past the wait
    with pytest.raises(DeviceBusy, match="shutting down"):
        await waiting
    release.set()
    assert await first == "running"
    assert log == ["running"]


@pytest.mark.asyncio
async def test_a_judging_spreads_its_rows_over_the_shared_pool_only_while_it_is_alone():
    judges, release, seen = JudgePool(2), threading.Event(), []

    def work(stop: threading.Event) -> None:
        seen.append(judges.alone())
        release.wait(10)

    try:
        first = asyncio.create_task(judges.run(work, timeout_s=30))
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(judges.run(work, timeout_s=30))  # starts while the first runs
        while len(seen) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, second)
    finally:
        release.set()
        await judges.close()
    assert seen == [True, False]


# --- the dataplane: a comparison whose client goes, and the gauges --------------------------------


def comparison() -> Comparison:
    call = doc_call()
    return Comparison.checked(call, np.zeros((2, 2), np.float32), None, False)


@pytest.fixture
def blocking_judge(monkeypatch):
    """moegrad.compare as the dataplane calls it, replaced by a judging that waits until released or stopped."""
    import moegrad_service.dataplane.judging as judging_module

    state = {"started": threading.Semaphore(0), "stopped": threading.Event(), "release": threading.Event(),
             "stops": []}
    real = judging_module.compare

    def judging(call, candidate, *, stop=None, **options):
        state["stops"].append(stop)
        state["started"].release()
        while not state["release"].is_set():
            if stop is not None and stop.wait(0.01):
                state["stopped"].set()
                raise DeadlineExceeded("stopped")
        return real(call, candidate, **options)

    monkeypatch.setattr(judging_module, "compare", judging)
    yield state
    state["release"].set()


@pytest.mark.asyncio
async def test_a_comparison_whose_client_went_is_stopped_and_counted_until_then(blocking_judge):
    async with open_dataplane(ReferenceBackend(warm_up=False), judge_workers=1) as dataplane:
        gone = asyncio.Event()
        first = asyncio.create_task(dataplane.compare(comparison(), timeout_s=30, disconnected=gone.wait))
        assert await asyncio.to_thread(blocking_judge["started"].acquire, True, 10)
        second = asyncio.create_task(dataplane.compare(comparison(), timeout_s=30))
        deadline = time.monotonic() + 20
        while dataplane.queue_depth < 1 and time.monotonic() < deadline:  # its call runs, then its judging waits
            await asyncio.sleep(0.01)
        # the queue gauge counts judging: one waiting, one running
        assert (dataplane.queue_depth, dataplane.in_flight) == (1, 1)
        gone.set()
        with pytest.raises(ClientDisconnected):
            await first
        assert await asyncio.to_thread(blocking_judge["stopped"].wait, 10)  # stopped, not run to its end
        blocking_judge["release"].set()
        outcome = await second
        assert outcome.report.verdict in ("pass", "warning", "fail")
        assert (dataplane.queue_depth, dataplane.in_flight) == (0, 0)


def test_the_queue_gauge_counts_comparisons_waiting_to_be_judged(serve, blocking_judge):
    from concurrent.futures import ThreadPoolExecutor

    from support.docexample import example_document

    body = pack(example_document(candidate={"dtype": "float32", "shape": [2, 2], "data": bytes(16)}))
    headers = {"Content-Type": "application/msgpack"}
    with serve(judge_workers=1) as client, ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(client.post, "/v1/moe_init_routing_v2_grad/compare", content=body, headers=headers)
                   for _ in range(2)]
        deadline = time.monotonic() + 20
        while gauge(client, "moegrad_inference_pending_request_count") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gauge(client, "moegrad_inference_pending_request_count") == 1  # the second, waiting for a judge
        assert gauge(client, "moegrad_inference_exec_count") == 1  # the first, being judged
        blocking_judge["release"].set()
        assert [answer.result(30).status_code for answer in answers] == [200, 200]


# --- tenants are tokens --------------------------------------------------------------------------


def test_a_tenant_is_its_tokens_place_never_the_token():
    from pydantic import SecretStr

    authenticator = Authenticator(Settings(backend="reference", auth_tokens=[SecretStr("alpha"), SecretStr("beta")]))
    assert authenticator.check("/v1/info", "Bearer beta") == "token-2"
    assert authenticator.check("/v1/info", "Bearer alpha") == "token-1"
    assert authenticator.check("/health/live", "") is None  # an open path has no tenant
    assert Authenticator(Settings(backend="reference")).check("/v1/info", "") is None  # no tokens: one tenant
