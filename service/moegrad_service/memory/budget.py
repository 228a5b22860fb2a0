"""The in-flight byte budget: what admitted requests, and the buffers kept for reuse, may hold at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

from moegrad import DeviceBusy, PayloadTooLarge

__all__ = ["MemoryBudget"]


class MemoryBudget:
    """The bytes that admitted requests may hold at once, in bytes.

    Before its body is read, a request reserves twice its bytes (:meth:`reserve_body`): the body
    itself, and as much again for its answer (grad_x, N x H elements: the body's size for a dropless
    call with top_k 2, less for a larger top_k). It is reserved from Content-Length or as the body
    arrives (chunked). Once the body is decoded, the request is topped up to what its shapes say it
    holds (:meth:`top_up`, moegrad_service.memory.peaks: a comparison's per-row sums, the grad_x of a
    call whose tokens are all dropped, a batch's items), and everything is given back once the
    answer is sent.
    The last eighth of the budget is kept for small reservations (up to SMALL_BYTES each): clients
    holding large bodies, even slow or stalled ones, cannot keep a small call out. Spare room may
    hold buffers kept for reuse (:meth:`hold_spare`, moegrad_service.memory.buffers), each held
    with the function that gives them up: a reservation that finds no room has those functions give
    them up first. Every release is also told to ``released``. Thread-safe.

    Args:
        limit_bytes: the budget.
        retry_after_s: the retry hint of the DeviceBusy a refusal raises.
        released: ``released(nbytes)``, told of every release, on the releasing thread (the
            service's heap trimmer, moegrad_service.memory.heap), or None.
    """

    #: What a request holds per byte of its body: the body, and as much again for its answer.
    HOLD_PER_BODY_BYTE = 2
    #: What a batch holds per byte of its body: the body, its calls decoded (msgpack copies each
    #: tensor's bytes out), their results and the reply packed from them; calls with top_k 1, whose
    #: grad_x is as large as their input, hold the most (bench/RESULTS.md, "Notes kept from earlier runs").
    BATCH_HOLD_PER_BODY_BYTE = 5
    #: A reservation up to this size (a body up to 1 MiB) may use the part of the budget kept for small ones.
    SMALL_BYTES = 2 << 20

    def __init__(
        self, limit_bytes: int, *, retry_after_s: float = 1.0, released: Callable[[int], None] | None = None
    ) -> None:
        self.limit_bytes = limit_bytes
        self._large_limit = limit_bytes - limit_bytes // 8
        self.retry_after_s = retry_after_s
        self._released = released
        self._held = 0
        self._lock = threading.Lock()
        #: ``reclaim(nbytes) -> bytes released``: each gives up spare buffers it holds (hold_spare).
        self._reclaimers: list[Callable[[int], int]] = []

    @property
    def held_bytes(self) -> int:
        return self._held

    def ceiling(self, nbytes: int) -> int:
        """The most a reservation of ``nbytes`` may find held, itself included: the whole budget for
        a small one, seven eighths for a larger one."""
        return self.limit_bytes if nbytes <= self.SMALL_BYTES else self._large_limit

    def reserve_body(self, body_bytes: int, *, so_far: int = 0, per_byte: int | None = None, extra: int = 0) -> int:
        """Reserve what a body of ``body_bytes`` holds until its answer is sent (``per_byte`` times
        its size, default HOLD_PER_BODY_BYTE; a batch's BATCH_HOLD_PER_BODY_BYTE) and ``extra``
        bytes besides (a v2 body's JSON part as it is parsed, given with the whole declared body);
        returns the bytes reserved, to give back with :meth:`release`.

        ``so_far``: the bytes of the same body already reserved (a body without Content-Length is
        reserved chunk by chunk as it arrives); the limits apply to the whole body so far, so a
        chunked body is as large a call as a declared one of its size.

        Raises:
            PayloadTooLarge: (413) the body could never fit, even with nothing else held.
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        per_byte = per_byte or self.HOLD_PER_BODY_BYTE
        held = body_bytes * per_byte + extra
        whole = (so_far + body_bytes) * per_byte + extra
        ceiling = self.ceiling(whole)
        if whole > ceiling:
            what = (
                "the body, and as much again for grad_x"
                if per_byte == self.HOLD_PER_BODY_BYTE
                else f"{per_byte} times the body: its calls decoded, their results and the reply"
            )
            if extra:
                what += f", and {extra} bytes for its JSON as it is parsed"
            raise PayloadTooLarge(
                f"a body of {so_far + body_bytes} bytes holds {whole} bytes while it is answered ({what}), over "
                f"{self._share(ceiling)}; send smaller calls or batches, or raise max_inflight_bytes"
            )
        self.reserve(held, whole=whole)
        return held

    def top_up(self, nbytes: int, *, whole: int, needs: str) -> None:
        """Reserve ``nbytes`` more for a request that then holds ``whole`` bytes: what its decoded
        shapes say answering it holds (moegrad_service.memory.peaks), ``needs`` in words.

        Raises:
            PayloadTooLarge: (413) ``whole`` could never fit, even with nothing else held.
            DeviceBusy: (503 + Retry-After) ``nbytes`` more do not fit now, beside what others hold.
        """
        ceiling = self.ceiling(whole)
        if whole > ceiling:
            raise PayloadTooLarge(
                f"this request holds {whole} bytes while it is answered ({needs}), over {self._share(ceiling)}; "
                "send smaller calls (fewer tokens; a comparison holds 792 bytes a token whatever H is) or "
                "smaller batches, or raise max_inflight_bytes"
            )
        self.reserve(nbytes, whole=whole)

    def _share(self, ceiling: int) -> str:
        share = "all" if ceiling == self.limit_bytes else "seven eighths"
        return (
            f"the {ceiling} bytes ({share} of the service's in-flight budget of {self.limit_bytes} bytes, "
            "max_inflight_bytes) that one request may take"
        )

    def reserve(self, nbytes: int, *, whole: int | None = None) -> None:
        """Take ``nbytes`` from the budget; ``whole``: what the request holds with them (the share of
        the budget it may take, :meth:`ceiling`, is decided by that), ``nbytes`` when None.

        Raises:
            PayloadTooLarge: (413) ``nbytes`` could never fit (over :meth:`ceiling`).
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        limit = self.ceiling(nbytes if whole is None else whole)
        if nbytes > limit:
            raise PayloadTooLarge(
                f"the request needs {nbytes} bytes, over the {limit} a call may take of the service's "
                f"in-flight budget of {self.limit_bytes} bytes (max_inflight_bytes); send smaller calls"
            )
        for first in (True, False):
            with self._lock:
                if self._held + nbytes <= limit:
                    self._held += nbytes
                    return
                shortfall, held = self._held + nbytes - limit, self._held
            if not (first and self._reclaim(shortfall)):
                raise DeviceBusy(
                    f"the service holds {held} of its {self.limit_bytes} in-flight bytes; retry later",
                    retry_after_s=self.retry_after_s,
                )

    def _reclaim(self, nbytes: int) -> int:
        """Have the holders of spare buffers give up at least ``nbytes`` (as many as they can);
        returns the bytes they gave back."""
        freed = 0
        for reclaim in list(self._reclaimers):
            freed += reclaim(nbytes - freed)
            if freed >= nbytes:
                break
        return freed

    def hold_spare(self, nbytes: int, reclaim: Callable[[int], int]) -> bool:
        """Take ``nbytes`` for a kept buffer if they fit now within seven eighths of the budget
        (never the part kept for small calls); False, taking nothing, when they do not.

        ``reclaim(nbytes) -> bytes released``: gives up the holder's kept buffers (oldest first)
        when a reservation finds no room."""
        with self._lock:
            if self._held + nbytes > self._large_limit:
                return False
            self._held += nbytes
            if reclaim not in self._reclaimers:
                self._reclaimers.append(reclaim)
            return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken by :meth:`reserve` or :meth:`hold_spare`."""
        with self._lock:
            self._held -= nbytes
        if self._released is not None:
            self._released(nbytes)
