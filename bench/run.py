"""``python -m bench.run [--quick|--full]`` (``make bench``): every benchmark, one run.

Sections, in this order (each one is skipped with a note when its module is not there):

1. kernel  -- ``bench.kernel.main(quick=...)`` (the kernels against NumPy; it writes its own section);
2. service -- :mod:`bench.service` (the service on loopback, the PyTriton peer, memory); this
   module writes its ``service`` and ``memory`` sections;
3. soak    -- ``bench.soak.main(duration_s=...)``: 60 s in full mode, shortened in quick mode;
4. the stand-alone benchmarks of :data:`PRINTED` (the torch op, the orders' differences, gRPC
   beside HTTP, the attacks, the gRPC attacks, the tenants, the order probe, the shrinker), each run as
   ``python -m <module>`` whose printed tables become its section, with the command and the machine.

Quick mode (the default) is sized to finish in under 5 minutes on the 2-core machine, the kernel
section included, as long as the PyTriton peer's venv exists (bench/_out/pytriton-venv, built once;
quick mode allows the build only a short time and otherwise skips the peer with a note). Results go
to bench/RESULTS.md (through :mod:`bench._results`); only the sections between this run's markers
are replaced.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import time
import traceback

from bench._results import HEADER, QUICK_BUDGET_S, RESULTS_PATH, machine, write_section
from support.launch import stop_on_sigterm

__all__ = ["main"]

SOAK_FULL_S = 60.0
SOAK_QUICK_S = 10.0
#: section -> (heading, module, its arguments in quick mode, in full mode): benchmarks that print their tables.
PRINTED: dict[str, tuple[str, str, list[str], list[str]]] = {
    "torch": ("The torch op on CPU, beside torch's own index_add_ and gather-sum", "bench.torch_op",
              ["--repeats", "3"], ["--repeats", "7"]),
    "orders": ("Elements where the device profiles' arithmetic differs", "bench.order_differences", [], []),
    "compare": ("The accuracy comparison against the grad call it judges (target: at most 10x)", "bench.compare_speed",
                ["--repeats", "3"], ["--repeats", "7"]),
    "explain": ("moegrad.explain beside compare and the grad call (targets: 1.5x compare, 15x the grad call)",
                "bench.explain_speed", ["--repeats", "3"], ["--repeats", "7"]),
    "reports": ("A compare report's row errors and its HTML page beside the compare", "bench.report_cost",
                ["--repeats", "1"], ["--repeats", "3"]),
    "explain-service": ("moegrad.explain of a DeepSeek-size call on the service", "bench.explain_service",
                        ["--tokens", "1024", "--repeats", "1"], ["--repeats", "3"]),
    "explain-matrix": ("moegrad.explain on the planted-fault matrix", "bench.explain_matrix",
                       ["--sample", "200"], []),
    "sweep": ("Sweep rate against one, two and three servers (Client.compare_many); what --reports costs",
              "bench.sweep", ["--cases", "300", "--repeat", "5", "--reports", "--failing", "10"],
              ["--cases", "600", "--repeat", "2", "--reports", "--failing", "30"]),
    "probe": ("The order probe: candidate calls and time per K", "bench.probe_speed", ["--repeats", "3"],
              ["--repeats", "7"]),
    "shrink": ("moegrad.shrink on a 448 MiB call: candidate calls and time", "bench.shrink_speed",
               ["--repeats", "1"], ["--repeats", "3"]),
    "grpc": ("gRPC beside HTTP (tritonclient)", "bench.grpc_bench", ["--quick"], []),
    "attack": ("Attacks: what each costs the server now", "bench.attack", ["--quick"], []),
    "grpc_attack": ("gRPC attacks: admission before a message is read", "bench.grpc_attack", ["--quick"], []),
    "tenancy": ("Tenants: memory per worst shape, stalled uploads, abandoned comparisons, a small call under a flood",
                "bench.tenancy", ["--quick"], []),
}


def _optional(module: str):
    """The module, or None when it does not exist (an ImportError inside it is still raised)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="the default: every section, shortened to finish in under 5 minutes")
    mode.add_argument("--full", dest="quick", action="store_false",
                      help="longer runs: more samples, the 60 s memory run and the 60 s soak")
    parser.add_argument("--skip", action="append", default=[], choices=["kernel", "service", "soak", *PRINTED],
                        help="leave a section out (repeatable); its part of RESULTS.md is kept as it was")
    args = parser.parse_args(argv)
    quick = args.quick
    started = time.monotonic()
    failed: list[str] = []
    notes: list[str] = []
    print(f"bench.run: {'quick' if quick else 'full'} mode; machine: {machine()}", flush=True)
    if not RESULTS_PATH.exists():
        RESULTS_PATH.write_text(HEADER.format(machine=machine()))

    def section(name: str, run) -> None:
        if name in args.skip:
            notes.append(f"{name}: skipped (--skip {name})")
            return
        t0 = time.monotonic()
        print(f"bench.run: --- {name} ---", flush=True)
        try:
            outcome = run()
        except Exception:  # noqa: BLE001 - one failing section must not lose the others
            traceback.print_exc()
            failed.append(name)
            notes.append(f"{name}: FAILED after {time.monotonic() - t0:.0f} s (traceback on stderr)")
            return
        notes.append(f"{name}: {outcome or 'done'} ({time.monotonic() - t0:.0f} s)")

    def kernel() -> str:
        module = _optional("bench.kernel")
        if module is None:
            return "not run: bench/kernel.py does not exist yet"
        module.main(quick=quick)
        return "bench.kernel.main(quick=%s)" % quick

    service_sections: dict[str, str] = {}

    def service() -> str:
        from bench import service as service_bench

        budget_s = QUICK_BUDGET_S - (time.monotonic() - started) if quick else None
        service_sections.update(service_bench.main(quick=quick, write=False, budget_s=budget_s))
        return "bench.service.main(quick=%s)" % quick

    def soak() -> str:
        module = _optional("bench.soak")
        if module is None:
            return "not run: bench/soak.py does not exist yet"
        duration_s = SOAK_QUICK_S if quick else SOAK_FULL_S
        if quick:
            print(f"bench.run: quick mode shortens the soak from {SOAK_FULL_S:.0f} s to {duration_s:.0f} s", flush=True)
        module.main(duration_s=duration_s)
        return (f"bench.soak.main(duration_s={duration_s:.0f})"
                + (f", shortened from {SOAK_FULL_S:.0f} s by quick mode" if quick else ""))

    def printed(name: str) -> str:
        heading, module, quick_args, full_args = PRINTED[name]
        if importlib.util.find_spec(module) is None:
            return f"not run: {module} does not exist"
        argv = [sys.executable, "-m", module, *(quick_args if quick else full_args)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv[1:])} exited with {done.returncode}:\n{done.stderr[-2000:]}")
        command = "python " + " ".join(argv[1:])
        write_section(name, f"## {heading}\n\n`{command}` on {machine()}\n\n{done.stdout.strip()}")
        return command

    section("kernel", kernel)
    section("service", service)
    section("soak", soak)
    for name in PRINTED:
        section(name, lambda name=name: printed(name))
    total_s = time.monotonic() - started
    summary = (f"\n\nLast `python -m bench.run {'--quick' if quick else '--full'}`: {total_s:.0f} s in all"
               + (f" (quick mode's budget: {QUICK_BUDGET_S:.0f} s)" if quick else "") + "; "
               + "; ".join(notes) + ".")
    for name, body in service_sections.items():
        write_section(name, body + (summary if name == "service" else ""))
    print(f"bench.run: done in {total_s:.0f} s" + ("" if not failed else f"; FAILED: {', '.join(failed)}"), flush=True)
    for note in notes:
        print(f"bench.run:   {note}")
    if quick and total_s > QUICK_BUDGET_S:
        print(f"bench.run: quick mode took {total_s:.0f} s, over its {QUICK_BUDGET_S:.0f} s budget", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
