"""The test-support package: what the tests (and the benchmarks) share, in one place.

Importable as ``support`` (pyproject's pytest ``pythonpath`` puts tests/ on ``sys.path``; bench/
puts it there too). Test modules import from here and never from each other; bench imports from
here and tests never import bench. The oracles here are independent of the code under test: they
import nothing of moegrad's numerics (oracle.py takes only the call object from moegrad).

- :mod:`support.docexample` -- the operator documentation's example, its result and its bits;
- :mod:`support.bits` -- bit-for-bit comparison (arrays viewed as unsigned integers);
- :mod:`support.slow_loops` -- the slow per-row oracles of the reference numerics (A2/A3, sequential,
  Ascend 950) and every add tree;
- :mod:`support.inputs` -- the reference tests' dtypes, K values and random calls;
- :mod:`support.oracle` -- the float64 accuracy oracle (golden, scale, figures, verdicts);
- :mod:`support.planted` -- the planted-fault matrix of moegrad.explain, from slow per-row loops;
- :mod:`support.routing` -- a forward routing (aclnnMoeInitRoutingV2) to generate realistic inputs;
- :mod:`support.kernel_paths` -- harness for the compiled and NumPy kernel path tests;
- :mod:`support.servicekit` -- in-process service helpers (bodies, replies, metrics, a gated backend hook);
- :mod:`support.dataplane_cases` -- dataplane scenarios run over each backend with no HTTP;
- :mod:`support.grpckit` -- protocol v2 over gRPC: calls, the invalid-input table, tritonclient inputs;
- :mod:`support.rawhttp` -- raw HTTP/1.1 on sockets: a local responder, one answer read off a socket;
- :mod:`support.launch` -- server processes on free loopback ports (tests/e2e, tests/deploy, bench/);
- :mod:`support.soak` -- the soak's workload and runner (bench.soak, tests/e2e/test_reliability.py);
- :mod:`support.attacks` -- the attack suite and its probes (bench.attack, tests/e2e/test_attacks_e2e.py).

tests/README.md maps these with the fixtures and markers.
"""
