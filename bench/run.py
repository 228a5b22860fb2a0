"""``python -m bench.run [--quick|--full]`` (``make bench``): every benchmark of issue 7, one run.

Sections, in this order (each one is skipped with a note when its module is not there):

1. kernel  -- ``bench.kernel.main(quick=...)`` (target 1; it writes its own section);
2. service -- :mod:`bench.service` (targets 2 and 3: the service on loopback, the PyTriton peer,
   memory); this module writes its ``service`` and ``memory`` sections;
3. soak    -- ``bench.soak.main(duration_s=...)``: 60 s in full mode, shortened in quick mode.

Quick mode (the default) is sized to finish in under 5 minutes on the 2-core machine, the kernel
section included, as long as the PyTriton peer's venv exists (bench/_out/pytriton-venv, built once;
quick mode allows the build only a short time and otherwise skips the peer with a note). Results go
to bench/RESULTS.md; only the sections between this run's markers are replaced.

This module also holds what the sections share: :func:`machine` (the machine description every
table carries) and :func:`write_section` (replace one marked section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

__all__ = ["QUICK_BUDGET_S", "RESULTS_PATH", "machine", "main", "write_section"]

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
#: Quick mode's promise: the whole run (kernel section and PyTriton peer included) ends within this.
QUICK_BUDGET_S = 300.0
SOAK_FULL_S = 60.0
SOAK_QUICK_S = 10.0

_HEADER = """# moegrad benchmark results

Written by `make bench` (`python -m bench.run`; quick mode unless `BENCH_ARGS=--full`). Each section
is replaced by the run that measures it and names the machine it ran on; issue 7 defines the
workloads (W1-W4, S1, S2) and the targets. Numbers from a shared or noisy machine are only
comparable as ratios measured side by side in one run.

Machine when this file was created: {machine}
"""


def machine() -> str:
    """One line: CPU model, cores, memory, NumPy and its BLAS threads, Python, kernel, date, load."""
    import numpy as np

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or model
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    memory = ""
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    load = ", load average %.1f/%.1f/%.1f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    return (f"{model}, {cores} cores ({usable} usable){memory}; NumPy {np.__version__}, {_blas_threads()}; "
            f"Python {platform.python_version()}; Linux {platform.release()}; "
            f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}{load}")


def _blas_threads() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        name = "unknown BLAS"
        try:
            import numpy as np

            config = np.show_config(mode="dicts")
            name = config["Build Dependencies"]["blas"]["name"]
        except Exception:  # noqa: BLE001 - only a description
            pass
        return f"BLAS {name}, threads unknown (threadpoolctl not installed)"
    pools = [f"{p.get('internal_api', '?')} {p.get('num_threads', '?')} threads" for p in threadpool_info()]
    return "BLAS " + (", ".join(pools) if pools else "not loaded")


def write_section(name: str, body: str, path: Path = RESULTS_PATH) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` with ``body``.

    The file is created with a header and the machine description when missing; a section whose
    markers are not there yet is appended. Other sections are left byte for byte as they were.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER.format(machine=machine())
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start >= 0 and stop >= 0:
        text = text[:start] + block + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


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
    parser.add_argument("--skip", action="append", default=[], choices=["kernel", "service", "soak"],
                        help="leave a section out (repeatable); its part of RESULTS.md is kept as it was")
    args = parser.parse_args(argv)
    quick = args.quick
    started = time.monotonic()
    failed: list[str] = []
    notes: list[str] = []
    print(f"bench.run: {'quick' if quick else 'full'} mode; machine: {machine()}", flush=True)
    if not RESULTS_PATH.exists():
        RESULTS_PATH.write_text(_HEADER.format(machine=machine()))

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

    section("kernel", kernel)
    section("service", service)
    section("soak", soak)
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


def stop_on_sigterm() -> None:
    """Let SIGTERM (``timeout``, a CI runner) unwind the bench like Ctrl-C does, so the ``finally``
    blocks stop every server and load process it started instead of leaving them running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
