"""Several replicas without a server: the choice of each attempt, the set-aside, the retries elsewhere.

Oracles: the power of two choices by its definition (of three replicas with distinct loads, the
least busy takes a call whenever it is one of the two drawn: 2 draws in 3; the busiest never), the
set-aside schedule from its documented rule (1 s after the first failure in a row, doubled, at most
30 s, at least the Retry-After) read off a fake clock, and the replies of httpx.MockTransport
handlers that stand for servers (the documentation's example answered with its documented bits).
"""

from __future__ import annotations

import asyncio
import random
import socket

import httpx
import msgpack
import numpy as np
import pytest

from moegrad import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    DeviceBusy,
    InvalidArgument,
    MoeInitRoutingV2GradCall,
    ReplicaStats,
    TransportError,
)
from moegrad.http._client import USE_CLIENT_DEFAULT
from moegrad.http._replicas import ReplicaSet, Resolve
from support.docexample import DOC_GRAD, DOC_IDX

A, B, C = "http://a.test:8000", "http://b.test:8000", "http://c.test:8000"
# The operator documentation's example: gradX = [[0.3, 0.3], [0.7, 0.7]] (float32 bits below).
EXAMPLE_BITS = np.array([[0x3E99999A, 0x3E99999A], [0x3F333334, 0x3F333334]], dtype=np.uint32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica_set(*urls: str, seed: int = 7, clock: FakeClock | None = None, **kwargs) -> ReplicaSet:
    return ReplicaSet([httpx.URL(u) for u in urls], clock=clock or FakeClock(), rng=random.Random(seed), **kwargs)


def host(replica) -> str:
    return replica.url.host


# ---- the choice ---------------------------------------------------------------------------------


def test_the_less_busy_of_two_replicas_drawn_at_random_takes_the_call():
    replicas = replica_set(A, B, C, seed=2024)
    for replica, load in zip(replicas.replicas, (0, 3, 6), strict=True):
        replica.in_flight = load
    counts = {"a.test": 0, "b.test": 0, "c.test": 0}
    for _ in range(3000):
        chosen = replicas.pick()
        counts[host(chosen)] += 1
        replicas.done(chosen, answered=False)  # the loads stay as set
    assert counts["c.test"] == 0  # the busiest loses every draw it is in
    assert 0.62 < counts["a.test"] / 3000 < 0.71  # the least busy is in 2 of the 3 pairs
    assert 0.29 < counts["b.test"] / 3000 < 0.38


def test_a_draw_picks_the_one_with_fewer_calls_in_flight_and_the_first_on_a_tie():
    class Drawn:
        def __init__(self, order):
            self.order = order

        def sample(self, pool, k):
            assert k == 2
            return [pool[i] for i in self.order]

    replicas = ReplicaSet([httpx.URL(u) for u in (A, B, C)], clock=FakeClock(), rng=Drawn((2, 1)))
    first = replicas.pick()  # all idle: the first drawn, c
    assert host(first) == "c.test"
    assert host(replicas.pick()) == "b.test"  # c has one in flight now, b none
    assert [s.in_flight for s in replicas.stats()] == [0, 1, 1]


def test_a_retry_never_goes_back_to_a_replica_the_call_tried_while_another_is_ready():
    replicas = replica_set(A, B, C)
    tried = [replicas.replicas[0], replicas.replicas[1]]
    for _ in range(50):
        chosen = replicas.pick(tried)
        assert host(chosen) == "c.test"
        replicas.done(chosen, answered=True)
    assert replicas.has_other(tried) and not replicas.has_other(replicas.replicas)


# ---- the set-aside ------------------------------------------------------------------------------


def test_a_failing_replica_is_set_aside_1_2_4_8_16_30_30_seconds_and_an_answer_ends_it():
    clock = FakeClock()
    replicas = replica_set(A, B, clock=clock)
    a = replicas.replicas[0]
    pauses = []
    for _ in range(7):
        a.in_flight += 1
        replicas.done(a, answered=False, failed=True)
        until = replicas.stats()[0].set_aside_until
        pauses.append(until - clock.now)
        clock.now = until  # back: tried again, and failing again
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    a.in_flight += 1
    replicas.done(a, answered=True)
    a.in_flight += 1
    replicas.done(a, answered=False, failed=True)
    assert replicas.stats()[0].set_aside_until == clock.now + 1.0
    assert replicas.stats()[0].failures == 8 and replicas.stats()[0].served == 1


def test_a_set_aside_replica_is_not_picked_until_its_time_has_passed():
    clock = FakeClock()
    replicas = replica_set(A, B, clock=clock)
    a = replicas.replicas[0]
    a.in_flight += 1
    replicas.done(a, answered=False, failed=True, retry_after_s=5.0)  # a 503's Retry-After beats 1 s
    for step in (0.0, 2.5, 4.99):
        clock.now = 100.0 + step
        assert all(host(replicas.pick()) == "b.test" for _ in range(20)), step
    clock.now = 105.0
    assert "a.test" in {host(replicas.pick()) for _ in range(40)}
    assert replicas.stats()[0].set_aside_until is None


def test_when_every_replica_is_set_aside_the_one_back_soonest_is_picked():
    clock = FakeClock()
    replicas = replica_set(A, B, C, clock=clock)
    for replica, retry_after_s in zip(replicas.replicas, (9.0, 3.0, 6.0), strict=True):
        replica.in_flight += 1
        replicas.done(replica, answered=False, failed=True, retry_after_s=retry_after_s)
    assert host(replicas.pick()) == "b.test"


def test_stats_are_frozen_and_name_each_replica():
    stats = replica_set(A, B).stats()
    assert stats == (ReplicaStats(url=A, served=0, failures=0, in_flight=0, set_aside_until=None),
                     ReplicaStats(url=B, served=0, failures=0, in_flight=0, set_aside_until=None))
    with pytest.raises(AttributeError):
        stats[0].served = 1  # type: ignore[misc]


# ---- a dns+ name --------------------------------------------------------------------------------


def addrinfo(*addresses: str) -> list:
    return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 8000))
            for a in addresses]


def test_a_name_is_resolved_first_then_every_refresh_and_kept_addresses_keep_their_counters():
    clock = FakeClock()
    replicas = ReplicaSet([httpx.URL("https://moegrad-replicas.ns.svc:8000/api")], dns=True, clock=clock,
                          rng=random.Random(1), refresh_s=30.0)
    assert replicas.due() == Resolve("moegrad-replicas.ns.svc", 8000)
    replicas.resolved(addrinfo("10.0.0.2", "10.0.0.1", "10.0.0.2"))
    assert [s.url for s in replicas.stats()] == ["https://10.0.0.1:8000/api", "https://10.0.0.2:8000/api"]
    first = replicas.replicas[0]
    assert (first.host_header, first.sni) == ("moegrad-replicas.ns.svc:8000", "moegrad-replicas.ns.svc")
    first.in_flight += 1
    replicas.done(first, answered=True)
    clock.now += 29.0
    assert replicas.due() is None
    clock.now += 1.0
    assert replicas.due() is not None
    assert replicas.due() is None  # one flow resolves while the others use what is known
    replicas.resolved(addrinfo("10.0.0.1", "fd00::3"))
    assert [(s.url, s.served, s.gone) for s in replicas.stats()] == [("https://10.0.0.1:8000/api", 1, False),
                                                                    ("https://[fd00::3]:8000/api", 0, False),
                                                                    ("https://10.0.0.2:8000/api", 0, True)]
    clock.now += 30.0
    replicas.due()
    replicas.resolved(socket.gaierror(-2, "Name or service not known"))  # a failed refresh keeps the known
    assert len(replicas.stats()) == 3  # the two known, and 10.0.0.2, gone with its counters
    assert [(s.url, s.gone) for s in replicas.stats()][-1] == ("https://10.0.0.2:8000/api", True)


def test_an_address_that_leaves_the_name_keeps_its_counters_as_gone_and_comes_back_with_them():
    clock = FakeClock()
    replicas = ReplicaSet([httpx.URL("http://svc:8000")], dns=True, clock=clock, rng=random.Random(1))
    replicas.due()
    replicas.resolved(addrinfo("10.0.0.1", "10.0.0.2"))
    lost = next(r for r in replicas.replicas if host(r) == "10.0.0.2")
    lost.in_flight += 1
    replicas.done(lost, answered=False, failed=True)  # its pod was killed
    clock.now += 30.0
    replicas.due()
    replicas.resolved(addrinfo("10.0.0.1"))  # ... and left the headless Service
    assert [(s.url, s.failures, s.failures_in_a_row, s.gone) for s in replicas.stats()] == [
        ("http://10.0.0.1:8000", 0, 0, False), ("http://10.0.0.2:8000", 1, 1, True)]
    assert [host(r) for r in replicas.replicas] == ["10.0.0.1"]  # never picked again
    clock.now += 30.0
    replicas.due()
    replicas.resolved(addrinfo("10.0.0.2", "10.0.0.1"))  # back (its pod restarted at the same address)
    assert [(s.url, s.failures, s.gone) for s in replicas.stats()] == [
        ("http://10.0.0.1:8000", 0, False), ("http://10.0.0.2:8000", 1, False)]


def test_a_name_that_does_not_resolve_at_first_is_a_transport_error():
    replicas = ReplicaSet([httpx.URL("http://nowhere.test:8000")], dns=True, clock=FakeClock())
    replicas.due()
    with pytest.raises(TransportError, match=r"cannot resolve nowhere\.test"):
        replicas.resolved(socket.gaierror(-2, "Name or service not known"))


@pytest.mark.parametrize(("base_url", "message"), [
    ([], "at least one replica"),
    ([A, A + "/"], "named twice"),
    ([A, "dns+http://svc:8000"], "pass it alone"),
    ("dns+http://10.0.0.1:8000", "not an address"),
    (["ftp://x"], "http:// or https://"),
])
def test_bad_replica_lists_are_refused_before_any_io(base_url, message):
    with pytest.raises(ValueError, match=message):
        Client(base_url)


# ---- the core and the shells --------------------------------------------------------------------


def reply_example(request: httpx.Request) -> httpx.Response:
    reply = {"grad_x": {"dtype": "float32", "shape": [2, 2], "data": EXAMPLE_BITS.tobytes()},
             "backend": "fake", "order": "ascend910b", "device": None, "timings_ms": {"total": 1.0}}
    return httpx.Response(200, content=msgpack.packb(reply, use_bin_type=True),
                          headers={"content-type": "application/msgpack"})


def example_call() -> MoeInitRoutingV2GradCall:
    return MoeInitRoutingV2GradCall(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=2)


def no_io(request: httpx.Request) -> httpx.Response:  # pragma: no cover - never called
    raise AssertionError("the flow is driven by hand")


def test_a_refused_connection_moves_the_call_to_another_replica_at_once():
    core = Client([A, B, C], transport=httpx.MockTransport(no_io), timeout_s=None, retries=3)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    second = flow.send(httpx.ConnectError("refused"))
    assert isinstance(second, httpx.Request) and second.url.host != first.url.host  # no wait in between
    third = flow.send(httpx.RemoteProtocolError("Server disconnected without sending a response."))
    assert isinstance(third, httpx.Request) and third.url.host not in {first.url.host, second.url.host}
    with pytest.raises(StopIteration) as stop:
        flow.send(reply_example(third))
    assert stop.value.value.server_url == f"http://{third.url.host}:8000"
    np.testing.assert_array_equal(stop.value.value.grad_x.view(np.uint32), EXAMPLE_BITS)
    stats = {s.url: s for s in core.replicas.stats()}
    assert [stats[f"http://{r.url.host}:8000"].failures for r in (first, second, third)] == [1, 1, 0]
    assert stats[f"http://{third.url.host}:8000"].served == 1
    # each failing replica's call went on elsewhere: one call moved off each; no answer since (in a row)
    assert [stats[f"http://{r.url.host}:8000"].moved for r in (first, second, third)] == [1, 1, 0]
    assert [stats[f"http://{r.url.host}:8000"].failures_in_a_row for r in (first, second, third)] == [1, 1, 0]


def test_a_call_retried_on_its_only_replica_moved_nowhere_and_an_answer_ends_the_run_of_failures():
    core = Client([A], transport=httpx.MockTransport(no_io), timeout_s=None, retries=2)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    assert flow.send(httpx.ConnectError("refused")) == 0.05  # the backoff (Retries.backoff_base_s): after a wait
    second = flow.send(None)
    assert core.replicas.stats()[0].failures_in_a_row == 1
    with pytest.raises(StopIteration):
        flow.send(reply_example(second))
    (stats,) = core.replicas.stats()
    assert (stats.failures, stats.moved, stats.failures_in_a_row, stats.served) == (1, 0, 0, 1)


def test_a_503_goes_to_another_replica_and_its_retry_after_sets_the_busy_one_aside():
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    busy = httpx.Response(503, headers={"Retry-After": "7"}, request=first)
    second = flow.send(busy)
    assert isinstance(second, httpx.Request) and second.url.host != first.url.host
    busy_stats = next(s for s in core.replicas.stats() if first.url.host in s.url)
    assert busy_stats.set_aside_until is not None and busy_stats.failures == 1


def test_a_504_is_retried_only_on_another_replica_and_a_4xx_never():
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    second = flow.send(httpx.Response(504, request=first))
    assert isinstance(second, httpx.Request) and second.url.host != first.url.host
    with pytest.raises(InvalidArgument):
        flow.send(httpx.Response(422, request=second, headers={"content-type": "application/problem+json"},
                                 json={"title": "t", "status": 422, "detail": "bad", "aclnn_status": 161002}))
    assert sorted((s.served, s.failures) for s in core.replicas.stats()) == [(0, 1), (1, 0)]



def test_a_replica_that_gives_no_reply_before_the_deadline_is_set_aside():
    # A hung replica (it accepts, then never answers) ends the call with DeadlineExceeded; it must
    # not stay in the draw, or every other call that draws it waits out its whole deadline too.
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=5.0)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    with pytest.raises(DeadlineExceeded):
        flow.send(httpx.ReadTimeout("timed out", request=first))
    hung = next(s for s in core.replicas.stats() if first.url.host in s.url)
    assert (hung.served, hung.failures, hung.in_flight) == (0, 1, 0)
    assert hung.set_aside_until is not None
    assert all(core.replicas.pick().url.host != first.url.host for _ in range(20))


def test_a_retry_after_longer_than_the_longest_set_aside_sets_a_replica_aside_30_seconds():
    clock = FakeClock()
    replicas = replica_set(A, B, clock=clock)
    a = replicas.replicas[0]
    a.in_flight += 1
    replicas.done(a, answered=False, failed=True, retry_after_s=86400.0)  # a server asking for a day
    assert replicas.stats()[0].set_aside_until == clock.now + 30.0

def down_or_example(down: str):
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == down:
            raise httpx.ConnectError("Connection refused")
        return reply_example(request)

    return handler, seen


def test_the_sync_and_async_clients_route_alike_around_a_replica_that_is_down():
    handler, seen = down_or_example("b.test")
    with Client([A, B, C], transport=httpx.MockTransport(handler), retries=3) as client:
        for _ in range(30):
            np.testing.assert_array_equal(client.run(example_call()).grad_x.view(np.uint32), EXAMPLE_BITS)
        sync_stats = {s.url: (s.served, s.failures) for s in client.stats}

    async def run_async():
        async_handler, async_seen = down_or_example("b.test")
        async with AsyncClient([A, B, C], transport=httpx.MockTransport(async_handler), retries=3) as client:
            results = await asyncio.gather(*(client.run(example_call()) for _ in range(30)))
            return results, {s.url: (s.served, s.failures) for s in client.stats}, async_seen

    results, async_stats, async_seen = asyncio.run(run_async())
    assert all(np.array_equal(r.grad_x.view(np.uint32), EXAMPLE_BITS) for r in results)
    for stats, hosts in ((sync_stats, seen), (async_stats, async_seen)):
        assert stats[B][0] == 0 and stats[B][1] == hosts.count("b.test") >= 1  # down: failures, no calls
        assert stats[A][0] + stats[C][0] == 30 and stats[A][0] > 0 and stats[C][0] > 0
    assert sync_stats[B][1] == 1  # one call after another: set aside at its first refusal, for 1 s


def test_when_every_replica_refused_the_call_waits_the_backoff_before_trying_again():
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=None, retries=3)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    first = next(flow)
    second = flow.send(httpx.ConnectError("refused"))
    assert isinstance(second, httpx.Request) and second.url.host != first.url.host
    # both refused: the second retry waits 0.05 s doubled once (Retries: backoff_base_s 0.05, doubling)
    assert flow.send(httpx.ConnectError("refused")) == pytest.approx(0.1)
    assert isinstance(flow.send(None), httpx.Request)


def test_both_clients_resolve_a_dns_name_and_send_its_host_to_each_address():
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["host"]))
        return reply_example(request)

    with Client("dns+http://localhost:8000", transport=httpx.MockTransport(handler)) as client:
        client.run(example_call())
        assert repr(client) == "Client(base_url='dns+http://localhost:8000')"

    async def run_async():
        async with AsyncClient("dns+http://localhost:8000", transport=httpx.MockTransport(handler)) as client:
            await client.run(example_call())
            return client.stats

    stats = asyncio.run(run_async())
    addresses = {a[4][0] for a in socket.getaddrinfo("localhost", 8000, type=socket.SOCK_STREAM)}
    assert {host for host, _ in seen} <= addresses and len(seen) == 2  # the resolver's own answer
    assert {header for _, header in seen} == {"localhost:8000"}
    assert sum(s.served for s in stats) == 1


# ---- a batch's items answered 503 / 504 ---------------------------------------------------------


def batch_reply(request: httpx.Request, *results: dict) -> httpx.Response:
    return httpx.Response(200, content=msgpack.packb({"results": list(results)}, use_bin_type=True),
                          headers={"content-type": "application/msgpack"}, request=request)


def example_item() -> dict:
    return {"grad_x": {"dtype": "float32", "shape": [2, 2], "data": EXAMPLE_BITS.tobytes()},
            "backend": "fake", "order": "ascend910b", "device": None, "timings_ms": {}}


def problem_item(status: int, detail: str, **fields) -> dict:
    """A failed item as docs/protocol.md's batch answer carries it (a draining server's 503 below)."""
    return {"problem": {"type": "about:blank", "title": "t", "status": status, "detail": detail, **fields}}


SHUTTING_DOWN = problem_item(503, "the service is shutting down", retry_after_s=2.0)


def items_sent(request: httpx.Request) -> int:
    return len(msgpack.unpackb(request.read(), raw=False))


def test_a_batch_item_answered_503_alone_goes_to_another_replica_and_the_draining_one_is_set_aside():
    clock = FakeClock()
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=None)._core
    core.replicas._clock = core._clock = clock
    flow = core.batch_flow([example_call()] * 3, USE_CLIENT_DEFAULT)
    first = next(flow)
    assert items_sent(first) == 3
    again = flow.send(batch_reply(first, example_item(), SHUTTING_DOWN, example_item()))
    assert isinstance(again, httpx.Request) and again.url.host != first.url.host  # at once, elsewhere
    assert items_sent(again) == 1  # only the refused item
    with pytest.raises(StopIteration) as stop:
        flow.send(batch_reply(again, example_item()))
    answers = stop.value.value
    assert [a.server_url for a in answers] == [f"http://{h}:8000" for h in
                                               (first.url.host, again.url.host, first.url.host)]
    assert all(np.array_equal(a.grad_x.view(np.uint32), EXAMPLE_BITS) for a in answers)
    stats = {s.url: s for s in core.replicas.stats()}
    draining, other = stats[f"http://{first.url.host}:8000"], stats[f"http://{again.url.host}:8000"]
    assert (draining.served, draining.failures, other.served, other.failures) == (1, 1, 1, 0)
    assert draining.set_aside_until == clock.now + 2.0  # its item's retry_after_s, past the first 1 s
    assert (draining.moved, other.moved) == (1, 0)  # its refused item went to the other replica


def test_a_batch_item_answered_422_is_never_sent_again():
    core = Client([A, B], transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.batch_flow([example_call()] * 2, USE_CLIENT_DEFAULT)
    first = next(flow)
    refused = problem_item(422, "bad", aclnn_status=161002, field="expanded_row_idx")
    with pytest.raises(StopIteration) as stop:
        flow.send(batch_reply(first, example_item(), refused))
    assert isinstance(stop.value.value[1], InvalidArgument) and stop.value.value[1].aclnn_status == 161002
    assert [(s.served, s.failures, s.set_aside_until) for s in core.replicas.stats()
            if first.url.host in s.url] == [(1, 0, None)]


def test_with_no_other_replica_a_503_item_waits_its_retry_after_and_the_retries_bound_the_resends():
    core = Client([A], transport=httpx.MockTransport(no_io), timeout_s=None, retries=1)._core
    flow = core.batch_flow([example_call()] * 2, USE_CLIENT_DEFAULT)
    first = next(flow)
    assert flow.send(batch_reply(first, SHUTTING_DOWN, example_item())) == 2.0  # the item's retry_after_s
    again = flow.send(None)
    assert isinstance(again, httpx.Request) and items_sent(again) == 1
    with pytest.raises(StopIteration) as stop:  # retries=1: that was the one resend
        flow.send(batch_reply(again, SHUTTING_DOWN))
    busy, done = stop.value.value
    assert isinstance(busy, DeviceBusy) and busy.retry_after_s == 2.0 and "shutting down" in busy.message
    assert np.array_equal(done.grad_x.view(np.uint32), EXAMPLE_BITS)


def test_a_504_item_is_sent_again_only_to_another_replica():
    core = Client([A], transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.batch_flow([example_call()], USE_CLIENT_DEFAULT)
    first = next(flow)
    with pytest.raises(StopIteration) as stop:
        flow.send(batch_reply(first, problem_item(504, "the deadline passed")))
    assert isinstance(stop.value.value[0], DeadlineExceeded)


def draining_a(request: httpx.Request) -> httpx.Response:
    """Replica a drains (every item 503, shutting down); the others answer the example."""
    count = items_sent(request)
    item = SHUTTING_DOWN if request.url.host == "a.test" else example_item()
    return batch_reply(request, *[item] * count)


def test_the_sync_and_async_clients_send_a_draining_replica_s_items_elsewhere_alike():
    with Client([A, B, C], transport=httpx.MockTransport(draining_a)) as client:
        answers = [a for _ in range(10) for a in client.batch([example_call()] * 4)]
        sync_a = next(s for s in client.stats if s.url == A)

    async def run_async():
        async with AsyncClient([A, B, C], transport=httpx.MockTransport(draining_a)) as client:
            batches = await asyncio.gather(*(client.batch([example_call()] * 4) for _ in range(10)))
            return [a for batch in batches for a in batch], next(s for s in client.stats if s.url == A)

    async_answers, async_a = asyncio.run(run_async())
    for every, a_stats in ((answers, sync_a), (async_answers, async_a)):
        assert len(every) == 40 and all(np.array_equal(r.grad_x.view(np.uint32), EXAMPLE_BITS) for r in every)
        assert all(r.server_url in (B, C) for r in every)  # no answer from the draining replica
        assert a_stats.failures == a_stats.served  # each batch it answered counted as a failure
