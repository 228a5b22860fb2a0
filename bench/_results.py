"""What every benchmark section shares: the machine it ran on and the results file it goes to.

:func:`machine` is the one-line machine description every table carries; :func:`write_section`
replaces one marked section of bench/RESULTS.md and leaves the others byte for byte as they were.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

__all__ = ["HEADER", "QUICK_BUDGET_S", "RESULTS_PATH", "machine", "write_section"]

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
#: Quick mode's promise: the whole run (kernel section and PyTriton peer included) ends within this.
QUICK_BUDGET_S = 300.0

HEADER = """# moegrad benchmark results

Written by `make bench` (`python -m bench.run`; quick mode unless `BENCH_ARGS=--full`). Each section
is replaced by the run that measures it and names the machine it ran on; bench/kernel.py and
bench/service/ define the workloads (W1-W4, S1, S2). Numbers from a shared or noisy machine are only
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
    text = path.read_text() if path.exists() else HEADER.format(machine=machine())
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start >= 0 and stop >= 0:
        text = text[:start] + block + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
