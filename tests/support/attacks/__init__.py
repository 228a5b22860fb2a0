"""The attack suite: attacks on a real ``moegrad-service``, each watched by probes.

Every attack runs against a reference-backend server on a free 127.0.0.1 port
(:func:`support.launch.moegrad_server`), over raw sockets (a client library would hide resets and
retry). While it runs, a probe process asks ``GET /health/live`` every 20 ms and sends the
documentation's example call every 200 ms on fresh connections. Each attack reports its figure
(what the server answered, how fast, what it held) as an :class:`Outcome`, judged on the same five
rules:

1. ``/health/live`` answers within 100 ms at the 99th percentile;
2. the example call succeeds within 1 s every time (the connection-cap attack excepted: at the cap
   every request, the probe's too, is answered 503 + Connection: close, which is its point);
3. the server's peak RSS (``VmHWM``, reset before each attack through ``/proc/<pid>/clear_refs``)
   stays within ``max_inflight_bytes`` + 256 MiB;
4. no answer is a 5xx other than 503 or 504;
5. no request meets a reset or a closed socket instead of an answer (where closing is the
   documented outcome -- a socket that never sent a byte -- the attack says so).

``quick`` runs each attack at a size for the tests (tests/e2e/test_attacks_e2e.py runs them so);
without it, at the size of the original finding (``python -m bench.attack``). Every loop is bounded
in count and in time, and all traffic stays on the loopback interface.

Modules: :mod:`.wire` (raw HTTP on one socket), :mod:`.probes` (the probe process, /proc memory),
:mod:`.outcome` (the judgement and the helpers around an attack), :mod:`.suite` (the attacks),
:mod:`.rpc` (the gRPC attacks; imported by name, as it loads grpc).
"""

from .outcome import ATTACKER_NICE, LIVE_P99_S, RSS_MARGIN_BYTES, VALID_WITHIN_S, Outcome, tally, watched
from .probes import Probes, p99, probe_main, reset_peak, rss_bytes
from .suite import (
    ATTACK_SETTINGS,
    AUTH_TOKEN,
    SERVER_ATTACKS,
    auth_fails_closed,
    auth_server,
    connection_cap,
    duplicate_keys,
    early_answers,
    huge_header,
    idle_sockets,
    msgpack_empty_maps,
    rss_after_load,
    sigterm_under_load,
    slow_senders,
    slowloris,
    stalled_uploads,
    unauthenticated_probing,
    unsupported_dtypes,
    uploads_past_the_queue,
    v2_json_ragged,
)
from .wire import Answer, example_call, exchange, request_head, valid_call_body

__all__ = [
    "ATTACKER_NICE",
    "ATTACK_SETTINGS",
    "AUTH_TOKEN",
    "LIVE_P99_S",
    "RSS_MARGIN_BYTES",
    "SERVER_ATTACKS",
    "VALID_WITHIN_S",
    "Answer",
    "Outcome",
    "Probes",
    "auth_fails_closed",
    "auth_server",
    "connection_cap",
    "duplicate_keys",
    "early_answers",
    "example_call",
    "exchange",
    "huge_header",
    "idle_sockets",
    "msgpack_empty_maps",
    "p99",
    "probe_main",
    "request_head",
    "reset_peak",
    "rss_after_load",
    "rss_bytes",
    "sigterm_under_load",
    "slow_senders",
    "slowloris",
    "stalled_uploads",
    "tally",
    "unauthenticated_probing",
    "unsupported_dtypes",
    "uploads_past_the_queue",
    "v2_json_ragged",
    "valid_call_body",
    "watched",
]
