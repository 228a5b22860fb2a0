"""The gRPC attacks against a real ``moegrad-service`` (support.attacks.rpc, at their quick size).

One reference-backend server with gRPC beside HTTP (support.attacks.rpc.GRPC_SETTINGS: a 128 MiB
in-flight budget, 24 MiB gRPC messages, max_queue 2, 300 RPCs at once, a bearer token), watched
by the HTTP probes (``GET /health/live`` every 20 ms, the documentation's example call every 200 ms)
and judged by the five rules of support.attacks; besides, each attack asserts its own figure:

- large ModelInfer messages without a token are refused UNAUTHENTICATED, and large messages to
  ServerLive (open) answered, without reading them: the server's RSS rises by a few MiB (grpc lets
  each stream send 64 KiB before its message is read), where it used to take every message whole;
- one call as large as the server takes holds at most 4 times its message, what it reserves;
- large calls with the token, all at once, and large health checks: the server holds no more than
  its budget for them (a message being read reserves 4 times the largest message gRPC takes);
- a message of typed contents over the limit is refused RESOURCE_EXHAUSTED before it is parsed,
  one under it is converted, and liveness answers within 1 s over HTTP and gRPC meanwhile;
- RPCs over ``max_connections`` are all RESOURCE_EXHAUSTED, none CANCELLED.
"""

from __future__ import annotations

import pytest

from support.attacks import Probes
from support.attacks import rpc as attack
from support.attacks.rpc import AUTH_TOKEN, GRPC_SETTINGS, grpc_server
from support.attacks.wire import MIB

pytestmark = pytest.mark.serial  # the probes' latency rules need the machine to themselves

LIVE_MAX_S = 1.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("grpc-attacks")
    with grpc_server(log_dir, GRPC_SETTINGS) as started, \
            Probes(started.server.port, log_dir, max_s=300, token=AUTH_TOKEN) as probes:
        attack.warm_up(started)
        yield started, probes


def run(target, name: str):
    started, probes = target
    outcome = getattr(attack, name)(started, probes, True)
    problems = [p for p in outcome.problems if not p.startswith("/health/live p99")]
    assert not problems, outcome.row()
    assert outcome.live_p99_s <= LIVE_MAX_S, outcome.row()
    return outcome


def test_messages_without_a_token_are_not_read(target):
    outcome = run(target, "unauthenticated_messages")
    assert set(outcome.statuses) == {"ModelInfer UNAUTHENTICATED", "ServerLive OK"}, outcome.row()
    assert outcome.figures["rise_mib"] <= 32, outcome.row()


def test_one_large_call_holds_no_more_than_it_reserves(target):
    outcome = run(target, "one_large_call")
    assert set(outcome.statuses) == {"OK"}, outcome.row()
    assert outcome.figures["times_message"] <= 4.0, outcome.row()  # HOLD_PER_MESSAGE_BYTE, docs/protocol.md


def test_large_calls_at_once_stay_within_the_budget(target):
    outcome = run(target, "messages_within_the_budget")
    assert set(outcome.statuses) <= {"ModelInfer OK", "ModelInfer UNAVAILABLE", "Check NOT_FOUND",
                                     "Check UNAVAILABLE"}, outcome.row()
    assert outcome.statuses["ModelInfer OK"] >= 1, outcome.row()
    assert outcome.figures["rise_mib"] <= GRPC_SETTINGS["max_inflight_bytes"] / MIB + 32, outcome.row()


def test_typed_contents_do_not_stall_liveness(target):
    outcome = run(target, "typed_contents")
    assert outcome.statuses == {"RESOURCE_EXHAUSTED": 1, "OK": 1}, outcome.row()
    assert outcome.figures["http_live_max_s"] <= LIVE_MAX_S, outcome.row()
    assert outcome.figures["grpc_live_max_s"] <= LIVE_MAX_S, outcome.row()


def test_rpcs_over_the_limit_are_resource_exhausted(target):
    outcome = run(target, "rpcs_over_the_limit")
    assert set(outcome.statuses) == {"RESOURCE_EXHAUSTED"}, outcome.row()
