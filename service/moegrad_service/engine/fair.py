"""A queue shared out fairly between tenants: each tenant's work in turn (round robin), its own in order.

With bearer tokens, each token is a tenant (moegrad_service.api.auth); without, every request is
one tenant's and the queue is first in, first out. A tenant with work waiting is a lane in a ring;
a worker takes the first work of the lane at the ring's head and moves that lane to the back, so
one tenant's flood of a thousand calls lets another tenant's one call wait behind at most one call
per other tenant with work waiting, not behind the thousand. A tenant whose lane empties leaves the
ring and joins at the back when it next has work: deficit round robin with a quantum of one job
(Shreedhar and Varghese, "Efficient Fair Queuing Using Deficit Round-Robin", SIGCOMM 1995).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Work waiting for a worker, taken in turn across tenants. Thread-safe; :meth:`get` blocks.

    Work given up on while it waits is not taken out (its worker skips it when its turn comes);
    ``len()`` counts it until then.
    """

    def __init__(self) -> None:
        self._lanes: collections.OrderedDict[Hashable, collections.deque[T]] = collections.OrderedDict()
        self._ready = threading.Condition(threading.Lock())
        self._count = 0

    def put(self, item: T, tenant: Hashable = None) -> None:
        """Add ``item`` at the end of ``tenant``'s lane (the lane joins the ring's back if it was empty)."""
        with self._ready:
            lane = self._lanes.get(tenant)
            if lane is None:
                lane = self._lanes[tenant] = collections.deque()
            lane.append(item)
            self._count += 1
            self._ready.notify()

    def get(self) -> T:
        """The next item in turn: the first of the lane at the ring's head, whose lane then goes to
        the back (or leaves the ring when empty). Blocks until there is one."""
        with self._ready:
            while not self._count:
                self._ready.wait()
            tenant, lane = self._lanes.popitem(last=False)
            item = lane.popleft()
            if lane:
                self._lanes[tenant] = lane
            self._count -= 1
            return item

    def __len__(self) -> int:
        return self._count

    def tenants(self) -> int:
        """The tenants with work waiting now."""
        with self._ready:
            return len(self._lanes)
