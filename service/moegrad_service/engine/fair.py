"""A queue shared out fairly between tenants: each tenant's work in turn, a tenant that had nothing
waiting first; each tenant's own work in order.

With bearer tokens, each token is a tenant (moegrad_service.api.auth); without, every request is
one tenant's and the queue is first in, first out. Each tenant with work waiting has a lane; the
lanes are taken in turn, one job a turn (deficit round robin with a quantum of one job: Shreedhar
and Varghese, "Efficient Fair Queuing Using Deficit Round-Robin", SIGCOMM 1995), with FlowQueue's
two lists (RFC 8290, "The Flow Queue CoDel Packet Scheduler and Active Queue Management
Algorithm", sections 1.3 and 4.2):

- a tenant that has no lane (nothing waiting, and its last turn has come round) gets one in the
  *new* list, which is served before the *old* one: its next job waits only for the jobs running
  now and for other new lanes' first jobs, never behind a flooding tenant's backlog;
- a lane that had its turn goes to the back of the *old* list, even when it is empty (so a tenant
  cannot be new again before every old lane has had a turn); an empty lane leaves when its turn
  comes round in the old list.

So a flood of a thousand calls from one tenant lets another tenant's one call wait for the next
free worker, and two floods share the workers call for call.

Work put as *express* (a small call) may also be taken by an express worker (``get(express=True)``):
the first lane, in the same turn order, whose first item is express; a lane whose first item is
not is passed over, so each tenant's work still starts in its order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")

_NONE = object()


class FairQueue(Generic[T]):
    """Work waiting for a worker, taken in turn across tenants, new tenants first. Thread-safe;
    :meth:`get` blocks.

    Work given up on while it waits is taken out with :meth:`remove`, so that what was behind it
    in its lane may be taken (by an express worker too) and nothing keeps it.
    """

    def __init__(self) -> None:
        # each lane holds (item, express) pairs
        self._new: collections.OrderedDict[Hashable, collections.deque[tuple[T, bool]]] = collections.OrderedDict()
        self._old: collections.OrderedDict[Hashable, collections.deque[tuple[T, bool]]] = collections.OrderedDict()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # any work waits: a worker may take it
        self._express_ready = threading.Condition(lock)  # express work waits: an express worker may
        self._count = 0
        self._express = 0  # express items waiting

    def put(self, item: T, tenant: Hashable = None, *, express: bool = False) -> None:
        """Add ``item`` at the end of ``tenant``'s lane: in the new list when the tenant has none.
        ``express``: an express worker may take it too (:meth:`get`)."""
        with self._ready:
            lane = self._new.get(tenant)
            if lane is None:
                lane = self._old.get(tenant)
            if lane is None:
                lane = self._new[tenant] = collections.deque()
            lane.append((item, express))
            self._count += 1
            self._ready.notify()
            if express:
                self._express += 1
                self._express_ready.notify()

    def get(self, *, express: bool = False) -> T:
        """The next item in turn: the first of the first new lane, else of the first old lane with
        work (empty old lanes met on the way leave); the lane then goes to the back of the old
        list. Blocks until there is one.

        ``express``: only the first item of a lane put as express, from the first such lane in the
        same order (blocks until there is one)."""
        with self._ready:
            if express:
                return self._get_express()
            while not self._count:
                self._ready.wait()
            lanes = self._new if self._new else self._old
            tenant, lane = lanes.popitem(last=False)
            while not lane:  # an old lane whose turn came round empty: it leaves
                tenant, lane = self._old.popitem(last=False)
            return self._took(tenant, lane)

    def _get_express(self) -> T:  # with the lock held
        while True:
            if self._express:
                for lanes in (self._new, self._old):
                    tenant = next((tenant for tenant, lane in lanes.items() if lane and lane[0][1]), _NONE)
                    if tenant is not _NONE:
                        return self._took(tenant, lanes.pop(tenant))
            self._express_ready.wait()

    def remove(self, item: T, tenant: Hashable = None) -> bool:
        """Take ``item`` (the very object put) out of ``tenant``'s lane, if it still waits there; a
        lane left empty in the new list leaves it (as if it had never been put). True if it did."""
        with self._ready:
            lanes = self._new if tenant in self._new else self._old
            lane = lanes.get(tenant)
            place = None if lane is None else next((i for i, (each, _) in enumerate(lane) if each is item), None)
            if lane is None or place is None:
                return False
            _, express = lane[place]
            del lane[place]
            self._count -= 1
            self._express -= express
            if not lane and lanes is self._new:
                del self._new[tenant]
            elif place == 0 and lane and lane[0][1]:  # express work now first in its lane
                self._express_ready.notify()
            return True

    def _took(self, tenant: Hashable, lane: collections.deque[tuple[T, bool]]) -> T:  # with the lock held
        item, express = lane.popleft()
        self._old[tenant] = lane  # it had its turn: to the back of the old list
        self._count -= 1
        self._express -= express
        if lane and lane[0][1]:  # express work now first in its lane: an express worker may take it
            self._express_ready.notify()
        return item

    def __len__(self) -> int:
        return self._count

    def tenants(self) -> int:
        """The tenants with work waiting now."""
        with self._ready:
            return sum(1 for lanes in (self._new, self._old) for lane in lanes.values() if lane)
