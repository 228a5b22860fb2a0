"""Service benchmarks: moegrad on loopback, its floors, a PyTriton peer, memory.

Everything runs on this machine, on 127.0.0.1 only, with bounded loops; every server this package
starts is stopped in a ``finally``. Three sections of bench/RESULTS.md come from here:

- ``service``: S1 sequential latency with the sync :class:`moegrad.Client` against its
  floors (the same bytes POSTed by bare httpx and by a plain socket; ``GET /health/live`` with the
  same client); S1 throughput with 16 concurrent requests from a separate load process (moegrad's
  clients, tritonclient, and a plain-socket load that measures the server's capacity); S2 end to
  end against the in-process time of the same call's encode + validate + compute + decode, and
  against raw TCP loopback moving the same bytes; the PyTriton peer (the naive NumPy function under
  PyTriton 0.7, bench/pytriton_peer/) against moegrad's v2 endpoint, both driven by
  tritonclient[http] on the same payloads.
- ``memory``: the server's peak RSS growth over one S2 call (VmHWM after resetting it
  through /proc/<pid>/clear_refs), and its RSS while serving S2 again and again.
- ``wire``: large calls against the loopback floor, side by side in one run (S2, and SL: DeepSeek-V3's
  N=4096, K=8, H=7168 bfloat16, 448 MiB in, 56 MiB out): raw socket -> v1 msgpack, -> v1 frames,
  -> v2 binary, ``moegrad.Client`` -> v1 msgpack and -> v1 frames; the server's peak RSS growth per
  call and its RSS after; 1,000 S1 calls one by one against one ``Client.batch``.

The workloads: S1 is the documentation's example (grad [[.1,.1],[.3,.3],[.2,.2],[.4,.4]] float32,
idx [2,0,1,3], K=2); S2 is N=1024, K=2, H=4096 float32 dropless (32 MiB in, 16 MiB out). Every
reply is checked bitwise against a result computed here (for K=2 the device order and the naive sum
are both v0 + v1 in float32).

Usage::

    .venv/bin/python -m bench.service [--quick|--full]     # only this module's sections
    .venv/bin/python -m bench.service wire [--sl-rounds N]  # only the wire tables, SL included, printed
    .venv/bin/python -m bench.run [--quick|--full]         # every section (make bench)

``--server-pythonpath DIR`` runs the moegrad server from another source tree (DIR/client and
DIR/service first on its PYTHONPATH), e.g. an export of an older commit for a before/after check.
The internal ``load`` command is the load-generating process (one JSON line per event on stdout).

Modules: ``common`` (paths, run sizes, statistics, progress), ``payloads`` (S1, S2, SL and the bitwise
checks), ``procs`` (the servers, /proc CPU and memory), ``clients`` (tritonclient, raw sockets, the
loopback floor), ``load`` (the load-generating process), ``measure`` (the service and memory
measurements), ``wire`` (the wire section), ``report`` (the sections' markdown), ``run`` (one run,
:func:`main`), ``__main__`` (the command line).
"""

from .common import FULL, QUICK, Mode
from .payloads import Payload, s1, s2
from .run import main

__all__ = ["FULL", "QUICK", "Mode", "Payload", "main", "s1", "s2"]
