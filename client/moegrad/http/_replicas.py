"""The replicas a client calls: which one takes each attempt, which are set aside, and what each served.

A client's ``base_url`` names its replicas (:func:`parse_replicas`):

- one ``http(s)://`` URL: one replica (the client behaves as a single-server client always did);
- a list of such URLs: one replica each;
- one ``dns+http(s)://NAME:PORT[/prefix]`` URL: the replicas are NAME's addresses (its A and AAAA
  records, from the standard library's ``getaddrinfo``), resolved at the first call and again every
  :data:`DNS_REFRESH_S` seconds, e.g. a Kubernetes headless Service's name. Requests go to each
  address, with ``Host`` (and, over TLS, the SNI name and the certificate check) set to NAME.

:class:`ReplicaSet` decides, with no I/O (the sans-I/O core, :mod:`moegrad.http._core`, asks it at every
attempt; a lock makes it safe for a client shared by threads):

- **which replica takes an attempt**: of two replicas picked at random, the one with fewer calls in
  flight (the "power of two choices": Mitzenmacher, *The Power of Two Choices in Randomized Load
  Balancing*, 2001), among those not set aside and not yet tried by this call;
- **which are set aside**: a replica whose attempt failed (no connection, a dropped connection, a
  503 or a 504, no reply before the call's deadline, or a batch answer some of whose items got a
  503 or a 504: a replica shutting down answers so while it drains) is not picked for ``min(1 s * 2**(n-1),
  30 s)`` after its n-th failure in a row (at least its Retry-After, at most 30 s), then tried
  again; an answer ends the run of failures. When every
  replica is set aside, the one back soonest is picked, so a single replica is always tried;
- **what each served** (:class:`ReplicaStats`, ``client.stats``);
- **what each server is** (:class:`ServerInfo`, one record per replica): the device profile it
  runs a call that names none on (the ``order`` of its ``GET /v1/info``, or of its answer to such
  a call), the wire formats it takes and the limits it states. Its ``/v1/info`` is asked once,
  for whichever is needed first; :meth:`ReplicaSet.profile` is the profile the client checks
  calls that name none by, :meth:`ReplicaSet.wire_formats` what a large call may travel as. A
  replica's record is forgotten when it fails (it may come back another server) and is empty for
  an address a name resolves to anew.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import httpx

from moegrad._errors import TransportError

__all__ = [
    "DNS_REFRESH_S",
    "SET_ASIDE_FIRST_S",
    "SET_ASIDE_MAX_S",
    "Replica",
    "ReplicaSet",
    "ReplicaStats",
    "Resolve",
    "ServerInfo",
    "is_address",
    "parse_replicas",
]

#: Seconds a replica is set aside after its first failure in a row, doubled at each further one ...
SET_ASIDE_FIRST_S = 1.0
#: ... up to this many seconds.
SET_ASIDE_MAX_S = 30.0
#: Seconds between two resolutions of a ``dns+`` URL's name.
DNS_REFRESH_S = 30.0
_DNS_PREFIX = "dns+"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaStats:
    """What one replica did for a client (``client.stats``, one per replica).

    Attributes:
        url: the replica's root URL (for a ``dns+`` URL, the address it resolved to).
        served: calls it answered (any HTTP answer that ended the call: a result, a 4xx, a 500).
        failures: attempts that failed on it and were retried elsewhere or given up: no connection,
            a dropped connection, 503 or 504, no reply before the call's deadline; and batch
            answers with items answered 503 or 504 (those items are sent again).
        in_flight: attempts on it now.
        set_aside_until: ``time.monotonic()`` seconds until which it is not picked, or None when
            it is not set aside.
        moved: calls that failed on it and were sent to another replica next (a batch's items
            answered 503 or 504 count as one).
        failures_in_a_row: its failures since its last answer: more than 0 when its last attempt
            failed (a replica that is down: lost, unless it answers again).
        gone: for a ``dns+`` URL, its address is no longer among the name's (a pod that left the
            headless Service); its counters are kept.
    """

    url: str
    served: int
    failures: int
    in_flight: int
    set_aside_until: float | None
    moved: int = 0
    failures_in_a_row: int = 0
    gone: bool = False


@dataclasses.dataclass(frozen=True)
class Resolve:
    """What a flow yields to have a name resolved: the client sends back ``socket.getaddrinfo(host,
    port, type=socket.SOCK_STREAM)``'s list, or the ``OSError`` it raised."""

    host: str
    port: int


#: The limits of ``/v1/info`` a server's record keeps (docs/protocol.md, "Other routes").
INFO_LIMITS = ("max_body_bytes", "max_elements", "max_batch_calls", "max_queue")


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the client knows of one replica's server: one record, from its ``GET /v1/info`` (asked
    once, for whichever of these is needed first) and from its answers to calls that name no profile.

    Attributes:
        profile: the device profile it runs a call that names none on (its ``order``), or None
            while unknown.
        wire_formats: the body formats it takes (``"msgpack"``, ``"frames"``), or None where it did
            not say (a server older than frames: msgpack only) or was not asked.
        limits: those of :data:`INFO_LIMITS` it states, by name.
        asked: its ``/v1/info`` was asked (answered or not): it is not asked again until it fails.
    """

    profile: str | None = None
    wire_formats: frozenset[str] | None = None
    limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    asked: bool = False

    @classmethod
    def of_info(cls, info: Mapping[str, Any]) -> ServerInfo:
        """The record of a ``/v1/info`` answer (a value of the wrong type counts as not said)."""
        order, formats = info.get("order"), info.get("wire_formats")
        return cls(
            profile=order if isinstance(order, str) and order else None,
            wire_formats=frozenset(f for f in formats if isinstance(f, str)) if isinstance(formats, list) else None,
            limits={k: v for k in INFO_LIMITS if type(v := info.get(k)) is int},
            asked=True,
        )


class Replica:
    """One replica's URL and counters (changed only under its :class:`ReplicaSet`'s lock).

    Attributes:
        url: its root URL (``http(s)://host:port[/prefix]``).
        host_header: the ``Host`` a request to it carries when it is an address of a ``dns+`` name
            (``NAME:PORT``), else None; ``sni`` the TLS server name then.
    """

    __slots__ = (
        "consecutive",
        "failures",
        "host_header",
        "in_flight",
        "moved",
        "served",
        "server",
        "set_aside_until",
        "sni",
        "url",
    )

    def __init__(self, url: httpx.URL, *, host_header: str | None = None, sni: str | None = None) -> None:
        self.url, self.host_header, self.sni = url, host_header, sni
        self.served = self.failures = self.in_flight = self.consecutive = self.moved = 0
        self.set_aside_until = 0.0
        self.server = ServerInfo()  # what it is, as far as the client knows

    @property
    def profile(self) -> str | None:
        """The profile it runs a call that names none on, once known (:attr:`ServerInfo.profile`)."""
        return self.server.profile

    def __repr__(self) -> str:
        return f"Replica({str(self.url)!r})"


def parse_replicas(value: Any, check_url: Callable[[Any], httpx.URL]) -> tuple[tuple[httpx.URL, ...], bool]:
    """``base_url`` as ``(urls, dns)``: the replicas' root URLs, and whether the one URL is a name to resolve.

    Args:
        value: a URL (str or ``httpx.URL``), a ``dns+http(s)://`` URL, or a non-empty list or tuple of URLs.
        check_url: checks one ``http(s)://`` URL (:mod:`moegrad.http._config`'s), raising TypeError/ValueError.

    Raises:
        TypeError: not a URL nor a list of them.
        ValueError: an empty list, a URL twice, a ``dns+`` URL in a list or with an IP address.
    """
    if isinstance(value, (str, httpx.URL)):
        text = str(value)
        if not text.lower().startswith(_DNS_PREFIX):
            return (check_url(value),), False
        url = check_url(text[len(_DNS_PREFIX) :])
        if is_address(url.host):
            raise ValueError(f"base_url={text!r}: a dns+ URL names a host to resolve, not an address")
        return (url,), True
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"base_url must be a str, an httpx.URL or a list of them, got {type(value).__name__}")
    if not value:
        raise ValueError("base_url must name at least one replica")
    urls = []
    for item in value:
        if isinstance(item, (str, httpx.URL)) and str(item).lower().startswith(_DNS_PREFIX):
            raise ValueError(f"base_url: {str(item)!r}: a dns+ URL names every replica; pass it alone")
        urls.append(check_url(item))
    seen = set()
    for url in urls:
        if str(url).rstrip("/") in seen:
            raise ValueError(f"base_url: {str(url)!r} is named twice")
        seen.add(str(url).rstrip("/"))
    return tuple(urls), False


def is_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (not a name to resolve)."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


class ReplicaSet:
    """The replicas of one client and the choice of each attempt's (no I/O; thread-safe).

    Args:
        urls: the replicas' root URLs; with ``dns``, the one URL whose host is resolved.
        dns: resolve ``urls[0]``'s host for the replicas (a ``dns+`` URL).
        clock: monotonic seconds (set-aside times, DNS refresh).
        rng: the random choice of two replicas (seed one in tests).
        set_aside_first_s, set_aside_max_s: the set-aside of a failing replica, in seconds.
        refresh_s: seconds between two resolutions of the name.
    """

    def __init__(
        self,
        urls: Sequence[httpx.URL],
        *,
        dns: bool = False,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        set_aside_first_s: float = SET_ASIDE_FIRST_S,
        set_aside_max_s: float = SET_ASIDE_MAX_S,
        refresh_s: float = DNS_REFRESH_S,
    ) -> None:
        self._clock, self._rng = clock, rng or random.Random()
        self._first_s, self._max_s, self._refresh_s = set_aside_first_s, set_aside_max_s, refresh_s
        self._lock = threading.Lock()
        self._name = urls[0] if dns else None
        self._replicas: list[Replica] = [] if dns else [Replica(url) for url in urls]
        self._gone: dict[str, Replica] = {}  # a name's addresses that left it, by address, with their counters
        self._next_resolve = 0.0  # clock reading after which the name is resolved again
        self._resolving = False

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The replicas known now."""
        with self._lock:
            return tuple(self._replicas)

    @property
    def name(self) -> httpx.URL | None:
        """The URL whose host is resolved for the replicas (scheme without ``dns+``), or None."""
        return self._name

    def stats(self) -> tuple[ReplicaStats, ...]:
        """Each replica's counters, in the order given (a name's addresses: sorted), then those of
        the addresses that left the name (``gone``)."""
        now = self._clock()
        with self._lock:
            listed = [(r, False) for r in self._replicas] + [(r, True) for r in self._gone.values()]
            return tuple(
                ReplicaStats(
                    url=str(r.url),
                    served=r.served,
                    failures=r.failures,
                    in_flight=r.in_flight,
                    set_aside_until=r.set_aside_until if r.set_aside_until > now else None,
                    moved=r.moved,
                    failures_in_a_row=r.consecutive,
                    gone=gone,
                )
                for r, gone in listed
            )

    # ---- the name's resolution ------------------------------------------------------------------

    def due(self) -> Resolve | None:
        """The resolution a flow should ask for now (it is then this flow's to finish), or None.

        A name is resolved before the first call and every ``refresh_s`` after; while one flow
        resolves it, the others use the addresses known (or, before the first, resolve too)."""
        if self._name is None:
            return None
        with self._lock:
            if self._replicas and (self._resolving or self._clock() < self._next_resolve):
                return None
            self._resolving = True
        return Resolve(self._name.host, self._name.port or (443 if self._name.scheme == "https" else 80))

    def resolved(self, answer: Any) -> None:
        """Take ``getaddrinfo``'s answer (or the OSError it raised) for :meth:`due`'s name.

        Raises:
            TransportError: the name has no address yet and this resolution failed or found none.
        """
        assert self._name is not None
        addresses = [] if isinstance(answer, BaseException) else sorted({info[4][0] for info in answer})
        with self._lock:
            self._resolving = False
            self._next_resolve = self._clock() + self._refresh_s
            if addresses:
                known = {**self._gone, **{r.url.host: r for r in self._replicas}}
                port = self._name.port
                host_header = self._name.host if port is None else f"{self._name.host}:{port}"
                self._replicas = [
                    known.get(address)
                    or Replica(self._name.copy_with(host=address), host_header=host_header, sni=self._name.host)
                    for address in addresses
                ]
                self._gone = {host: r for host, r in known.items() if host not in addresses}
            if self._replicas:
                return
        why = f"{type(answer).__name__}: {answer}" if isinstance(answer, BaseException) else "no address"
        raise TransportError(f"cannot resolve {self._name.host} for the replicas of dns+{self._name}: {why}")

    # ---- an attempt ---------------------------------------------------------------------------

    def pick(self, tried: Sequence[Replica] = ()) -> Replica:
        """The replica for an attempt (its in-flight count taken; give it back with :meth:`done`).

        Of the replicas neither set aside nor in ``tried`` (or, when none is left, of those not set
        aside; or, when all are, the one back soonest), two are drawn at random and the one with
        fewer calls in flight is picked (the first drawn on a tie). When the last of ``tried`` failed
        and another replica is picked, the call counts as moved off it (:attr:`ReplicaStats.moved`).

        Raises:
            TransportError: there is no replica (a name that resolved to none).
        """
        with self._lock:
            now = self._clock()
            if not self._replicas:
                raise TransportError(f"no replica of {self._name} is known")
            ready = [r for r in self._replicas if r.set_aside_until <= now]
            fresh = [r for r in ready if r not in tried]
            pool = fresh or ready or [min(self._replicas, key=lambda r: r.set_aside_until)]
            if len(pool) == 1:
                choice = pool[0]
            else:
                first, second = self._rng.sample(pool, 2)
                choice = second if second.in_flight < first.in_flight else first
            choice.in_flight += 1
            if tried and tried[-1] is not choice and tried[-1].consecutive:  # it failed this call: moved here
                tried[-1].moved += 1
            return choice

    def take(self, replica: Replica) -> Replica:
        """``replica`` for an attempt that must go to it (its in-flight count taken, as :meth:`pick`'s)."""
        with self._lock:
            replica.in_flight += 1
            return replica

    def has_other(self, tried: Collection[Replica]) -> bool:
        """Whether a replica not in ``tried`` and not set aside could take the next attempt now."""
        with self._lock:
            now = self._clock()
            return any(r.set_aside_until <= now and r not in tried for r in self._replicas)

    def done(
        self, replica: Replica, *, answered: bool, failed: bool = False, retry_after_s: float | None = None
    ) -> None:
        """An attempt on ``replica`` ended: ``answered`` (an answer that ends the call: it served it),
        ``failed`` (no connection, a dropped connection, 503 or 504, no reply in time: it is set
        aside; at least ``retry_after_s`` seconds when given, at most ``set_aside_max_s``), or
        neither (the caller gave up on the attempt)."""
        with self._lock:
            replica.in_flight -= 1
            if answered:
                replica.served += 1
                replica.consecutive = 0
                replica.set_aside_until = 0.0
            elif failed:
                self._fail(replica, retry_after_s)

    def set_aside(self, replica: Replica, *, retry_after_s: float | None = None) -> None:
        """``replica`` answered, but some of the calls its answer holds failed as a failing replica's
        do (a batch whose items got 503, busy or shutting down, or 504): count a failure and set it
        aside as :meth:`done` does a failed attempt's (its attempt was already given back)."""
        with self._lock:
            self._fail(replica, retry_after_s)

    # ---- the replicas' device profiles --------------------------------------------------------

    def learn(self, url: str | None, order: Any) -> None:
        """The replica whose root URL is ``url`` ran a call that named no profile on ``order``."""
        with self._lock:
            for replica in self._replicas:
                if str(replica.url) == url:
                    profile = order if isinstance(order, str) and order else None
                    replica.server = dataclasses.replace(replica.server, profile=profile)
                    return

    def learn_info(self, url: str | None, info: Mapping[str, Any] | None) -> None:
        """The ``/v1/info`` answer of the replica whose root URL is ``url`` (None: it was asked and
        did not answer): its record, which is not asked again until the replica fails."""
        with self._lock:
            for replica in self._replicas:
                if str(replica.url) == url:
                    replica.server = ServerInfo(asked=True) if info is None else ServerInfo.of_info(info)
                    return

    def profile(self) -> str | None:
        """The profile the replicas that may take a call run calls that name none with, when each
        one's is known and they are one; else None (one unknown, or replicas that differ). A
        replica set aside whose profile is unknown (forgotten when it failed) is left out until it
        is back."""
        with self._lock:
            now = self._clock()
            profiles = {r.profile for r in self._replicas if r.profile is not None or r.set_aside_until <= now}
        return profiles.pop() if len(profiles) == 1 else None

    def wire_formats(self) -> frozenset[str] | None:
        """The body formats every replica whose ``/v1/info`` was asked takes (msgpack alone where
        one did not say); None when none was asked."""
        with self._lock:
            asked = [r.server.wire_formats or frozenset({"msgpack"}) for r in self._replicas if r.server.asked]
        return frozenset.intersection(*asked) if asked else None

    def unasked(self, *, profile_known_too: bool = False) -> tuple[Replica, ...]:
        """The replicas whose ``/v1/info`` was not asked (and, unless ``profile_known_too``, whose
        profile is unknown); each is marked asked now, so that concurrent calls ask it once."""
        with self._lock:
            found = tuple(r for r in self._replicas if not r.server.asked and (profile_known_too or r.profile is None))
            for replica in found:
                replica.server = dataclasses.replace(replica.server, asked=True)
            return found

    def profiles(self) -> dict[str, str | None]:
        """Each replica's root URL -> its profile, or None when unknown."""
        with self._lock:
            return {str(r.url): r.profile for r in self._replicas}

    def _fail(self, replica: Replica, retry_after_s: float | None) -> None:
        """One more failure in a row of ``replica``'s: set it aside and forget its record (the lock held)."""
        replica.server = ServerInfo()
        replica.failures += 1
        replica.consecutive += 1
        pause_s = min(self._first_s * 2 ** (replica.consecutive - 1), self._max_s)
        # a Retry-After past the longest set-aside (a day) would leave a replica out that long
        replica.set_aside_until = self._clock() + min(max(pause_s, retry_after_s or 0.0), self._max_s)
