"""The reference kernel against the machine's copy bandwidth and the naive NumPy sum.

Run: ``python -m bench.kernel [--quick|--full]`` (``make bench`` calls :func:`main` with quick=True).

For each workload W1-W6 (:data:`WORKLOADS`) it builds the inputs from a forward routing, then repeats, in
turns so that every method sees the same machine load:

- ``copyto``: ``numpy.copyto`` of a 512 MiB float64 buffer; bandwidth counts read + write (1 GiB);
- ``fast``: ``moe_init_routing_v2_grad`` on the compiled path (numba), order ascend910b, bit-exact,
  into a gradX buffer written before (``out=``); ``fast_new``: the same allocating its result;
- ``fallback``: the same call on the NumPy path (what runs where numba is not installed);
- ``naive``: ``grad_expanded_x.astype(float32)[idx.reshape(N, K)].sum(1)`` (not bit-exact; with the
  skipped slots of W3/W4 pointed at row 0 beforehand, so it times the gather and sum only);
- ``gather``: the rows the call reads, read plainly (:func:`gather_rows`): what they take to arrive
  from memory in the kernel's order, without its prefetch hints, computing or writing nothing.

Each method's time is its best of the repetitions. Effective bandwidth = (bytes of the gathered
rows that are read, skipped slots excluded + index bytes + grad_x bytes written) / time. Peak
memory: a subprocess per workload and path builds the inputs, runs the call once, resets the
peak-RSS mark (``/proc/self/clear_refs``), runs it again and reports ``VmHWM`` minus the RSS before
the call minus grad_x itself (numba's allocations are invisible to tracemalloc, RSS sees them).
The section goes to bench/RESULTS.md between ``<!-- kernel:begin -->`` and ``<!-- kernel:end -->``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from moegrad import MoeInitRoutingV2GradCall, accumulation_schedule
from moegrad.numerics import accumulate, compiled_kernel_available, kernel_threads

__all__ = ["WORKLOADS", "Workload", "main"]

_COPY_BYTES = 512 << 20


@dataclass(frozen=True)
class Workload:
    """One benchmark workload. ``capacity`` > 0: drop/pad; ``active_num`` > 0: active mode."""

    name: str
    tokens: int
    top_k: int
    hidden: int
    dtype: np.dtype
    experts: int
    capacity: int = 0
    active_num: int = 0

    @property
    def mode(self) -> str:
        return "drop/pad" if self.capacity else ("active" if self.active_num else "dropless")

    def describe(self) -> str:
        parts = [f"N={self.tokens}", f"K={self.top_k}", f"H={self.hidden}", self.dtype.name, self.mode]
        if self.capacity:
            parts[3:3] = [f"E={self.experts}", f"C={self.capacity}"]
        if self.active_num:
            parts.append(f"A={self.active_num}")
        return " ".join(parts)


WORKLOADS = (
    Workload("W1", 4096, 8, 7168, np.dtype(ml_dtypes.bfloat16), experts=256),
    Workload("W2", 8192, 2, 4096, np.dtype(np.float32), experts=8),
    Workload("W3", 8192, 8, 2048, np.dtype(np.float16), experts=64, capacity=1024),
    Workload("W4", 512, 256, 1024, np.dtype(np.float32), experts=512, active_num=512 * 256 // 2),
    Workload("W5", 65536, 2, 256, np.dtype(np.float16), experts=64),
    Workload("W6", 512, 130, 1024, np.dtype(np.float32), experts=256),
)
_TARGET_BANDWIDTH = {"W1", "W2", "W3", "W4", "W5", "W6"}  # fast >= 0.7 x copyto
_BANDWIDTH_SHARE = 0.7
_TARGET_NAIVE = {"W1", "W2", "W4"}  # fast >= 3 x faster than naive


def routed_index(rng: np.random.Generator, w: Workload) -> np.ndarray:
    """expanded_row_idx of a forward routing: each token's K distinct experts, slots stably sorted by
    expert; dropless/active: the slot's sorted position; drop/pad: row e*C + rank, or -1 past C."""
    experts = np.argsort(rng.random((w.tokens, w.experts), dtype=np.float32), axis=1)[:, :w.top_k]
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    position = np.empty(flat.size, dtype=np.int64)
    position[order] = np.arange(flat.size)
    if not w.capacity:
        return position.astype(np.int32)
    first = np.searchsorted(flat[order], np.arange(w.experts))
    rank = position - first[flat]
    return np.where(rank < w.capacity, flat * w.capacity + rank, -1).astype(np.int32)


def build(w: Workload, seed: int = 0) -> MoeInitRoutingV2GradCall:
    """The validated call of workload ``w``: normal gradients (a 4 Mi-value random block, repeated:
    the kernel's speed does not depend on the values, and making 470 MB of fresh ones takes seconds)."""
    rng = np.random.default_rng(seed)
    index = routed_index(rng, w)
    if w.capacity:
        rows: tuple[int, ...] = (w.experts, w.capacity)
    else:
        rows = (w.active_num or w.tokens * w.top_k,)
    block = rng.standard_normal(1 << 22, dtype=np.float32).astype(w.dtype)
    grad = np.resize(block, (*rows, w.hidden))
    return MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=w.top_k,
                                    drop_pad_mode=1 if w.capacity else 0, active_num=w.active_num)


def run_call(call: MoeInitRoutingV2GradCall, kernel: str, out: np.ndarray | None = None) -> np.ndarray:
    """moe_init_routing_v2_grad(call) on the named path ("numba" or "numpy"), into ``out`` when given
    (as the operator writes into the gradX its caller allocated), else into a new array (as the
    public function does)."""
    if out is None:
        out = np.empty((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype)
    return accumulate(call, accumulation_schedule(call.top_k), out, kernel=kernel)


def moved_bytes(call: MoeInitRoutingV2GradCall) -> int:
    """Gathered rows actually read + index + grad_x written."""
    index = call.expanded_row_idx
    rows = call.grad_expanded_x.reshape(-1, call.hidden_size)
    used = int(np.count_nonzero((index >= 0) & (index < rows.shape[0])))
    row_bytes = call.hidden_size * rows.itemsize
    return used * row_bytes + index.nbytes + call.num_tokens * row_bytes


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(w: Workload, repeats: int, slow_repeats: int, with_fallback: bool = True) -> dict:
    """Times of every method on workload ``w``, in turns; plus whether fast and fallback agree bitwise."""
    call = build(w)
    rows = call.grad_expanded_x.reshape(-1, w.hidden)
    index = call.expanded_row_idx.astype(np.intp)
    index[(index < 0) | (index >= rows.shape[0])] = 0  # naive: skipped slots read row 0 (timing only)
    naive_index = index.reshape(w.tokens, w.top_k)
    source = np.ones(_COPY_BYTES // 8, dtype=np.float64)
    target = np.empty_like(source)
    np.copyto(target, source)  # pages touched before timing
    fast_kernel = "numba" if compiled_kernel_available() else "numpy"
    fast = run_call(call, fast_kernel)  # compiles (or loads the cache) and starts the pool
    gather = gather_rows(call)
    out = np.zeros_like(fast)  # gradX written in place, pages touched: like copyto's target
    same_bits = None
    methods = {
        "copyto": lambda: np.copyto(target, source),
        "fast": lambda: run_call(call, fast_kernel, out),
        "fast_new": lambda: run_call(call, fast_kernel),
        "naive": lambda: rows.astype(np.float32)[naive_index].sum(1),
    }
    if gather is not None:
        methods["gather"] = gather
    if with_fallback:
        methods["fallback"] = lambda: run_call(call, "numpy", out)
        fallback = run_call(call, "numpy")
        same_bits = bool(np.array_equal(fast.view(np.uint8), fallback.view(np.uint8)))
        del fallback
    del fast
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(repeats):
        for name, fn in methods.items():
            if name in ("naive", "fallback") and rep >= slow_repeats:
                continue
            times[name].append(_timed(fn))
    best = {name: min(values) for name, values in times.items()}
    return {
        "workload": w, "call": call, "best": best, "samples": {k: len(v) for k, v in times.items()},
        "moved": moved_bytes(call), "grad_x": w.tokens * w.hidden * w.dtype.itemsize,
        "same_bits": same_bits,
    }


# --------------------------------------------------------------------------------------------------
# What the machine gave us while the workloads ran: read bandwidth and how much of a second core.
# --------------------------------------------------------------------------------------------------

_probes = None


def _probe_kernels():
    """(read_stream, spin) compiled with numba, or None without it."""
    global _probes
    if _probes is None:
        try:
            from numba import njit
        except ImportError:
            _probes = False
            return None

        @njit(nogil=True, cache=True)
        def read_stream(words):  # sums every 8-byte word: a pure read stream
            total = np.uint64(0)
            for i in range(words.shape[0]):
                total += words[i]
            return total

        @njit(nogil=True, cache=True)
        def spin(rounds):  # registers only: a pure compute loop
            x = np.uint64(88172645463325252)
            for _ in range(rounds):
                x ^= x << np.uint64(13)
                x ^= x >> np.uint64(7)
                x ^= x << np.uint64(17)
            return x

        _probes = (read_stream, spin)
    return _probes or None


_touch = None


@functools.cache
def _gather_pool(lanes: int) -> ThreadPoolExecutor:
    """The threads gather_rows reads on, one pool per lane count, kept for the run."""
    return ThreadPoolExecutor(lanes, thread_name_prefix="gather")


def gather_rows(call: MoeInitRoutingV2GradCall):
    """What reading the call's rows costs: a function that loads one byte of every 64-byte line of
    each row the call reads, slot by slot in the kernel's order, on as many threads as the kernel's
    lanes (equal shares of the slots), with no prefetch hints, writing nothing. None without numba."""
    global _touch
    if _touch is None:
        try:
            from numba import njit
        except ImportError:
            return None

        @njit(nogil=True, cache=True)
        def touch(rows, index, start, stop):  # rows [R, row bytes] uint8
            total = np.uint64(0)
            for i in range(start, stop):
                r = index[i]
                if 0 <= r < rows.shape[0]:
                    for j in range(0, rows.shape[1], 64):
                        total += rows[r, j]
            return total

        _touch = touch
    grad = call.grad_expanded_x
    rows = grad.reshape(-1, call.hidden_size).view(np.uint8)
    index = np.ascontiguousarray(call.expanded_row_idx, dtype=np.int32)
    lanes = max(1, kernel_threads())
    bounds = np.linspace(0, index.size, lanes + 1).astype(int)
    spans = list(itertools.pairwise(bounds))
    _touch(rows, index, 0, min(8, index.size))
    pool = _gather_pool(lanes)
    return lambda: list(pool.map(lambda span: _touch(rows, index, *span), spans))


def probe(repeats: int = 5) -> dict | None:
    """Read-stream bandwidth on 512 MiB with 1 and 2 threads, and the speedup of a compute-only loop
    run on 2 threads at once over 1 (2.0 when both cores are ours); best of ``repeats``."""
    kernels = _probe_kernels()
    if kernels is None:
        return None
    read_stream, spin = kernels
    words = np.ones(_COPY_BYTES // 8, dtype=np.uint64)
    halves = (words[: words.size // 2], words[words.size // 2:])
    rounds = 60_000_000  # about 0.15 s on one free core
    read_stream(words[:8])
    spin(10)
    best = {"read1": [], "read2": [], "spin1": [], "spin2": []}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            best["read1"].append(_timed(lambda: read_stream(words)))
            best["read2"].append(_timed(lambda: list(pool.map(read_stream, halves))))
            best["spin1"].append(_timed(lambda: spin(rounds)))
            best["spin2"].append(_timed(lambda: list(pool.map(spin, (rounds, rounds)))))
    t = {k: min(v) for k, v in best.items()}
    return {"read1_gbs": _COPY_BYTES / t["read1"] / 1e9, "read2_gbs": _COPY_BYTES / t["read2"] / 1e9,
            "cores": 2 * t["spin1"] / t["spin2"]}


# --------------------------------------------------------------------------------------------------
# Peak memory, in a subprocess per workload and path.
# --------------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(name: str, kernel: str) -> dict:
    w = next(w for w in WORKLOADS if w.name == name)
    tiny = dataclasses.replace(w, tokens=4, hidden=64, capacity=min(w.capacity, 4),
                               active_num=2 * w.top_k if w.active_num else 0)
    run_call(build(tiny), kernel)  # compile / load the cache and start the pool's threads, on small arrays
    call = build(w)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    before = _status_kib("VmRSS")
    out = run_call(call, kernel)  # its buffers are new: none of them was allocated at this size before
    peak = _status_kib("VmHWM")
    return {"extra_bytes": (peak - before) * 1024 - out.nbytes, "grad_x_bytes": out.nbytes, "reset": reset}


def peak_extra(name: str, kernel: str) -> dict:
    """Peak RSS growth of one call beyond grad_x, measured in a fresh interpreter."""
    command = [sys.executable, "-m", "bench.kernel", "--memory", name, "--kernel", kernel]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------------------

def _machine() -> str:
    try:
        from bench._results import machine
        line = machine()
    except ImportError:
        import platform

        line = f"{platform.processor()}, {os.cpu_count()} cores; NumPy {np.__version__}; Python {platform.python_version()}"
    try:
        import numba

        compiled = f"numba {numba.__version__}"
    except ImportError:
        compiled = "numba not installed (the fast path is the NumPy path)"
    return f"{line}; {compiled}; reference pool: {kernel_threads()} threads"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "**MISS**")


def render(results: list[dict], memory: dict[tuple[str, str], dict], quick: bool, elapsed_s: float,
           machine_before: str, load_after: str, probes: list[dict | None]) -> str:
    mib = 2**20
    lines = [
        "## Reference kernel",
        "",
        f"Command: `python -m bench.kernel {'--quick' if quick else '--full'}` (also run by `make bench` "
        f"through `python -m bench.run`); {elapsed_s:.0f} s. Machine: {machine_before}; load average after: {load_after}.",
        "",
        "Floor: `numpy.copyto` of 512 MiB (float64) into a buffer already written once, read + write counted, "
        "timed in turns with the other methods inside each workload's loop. Effective bandwidth = (gathered rows "
        "read, skipped slots excluded + index + grad_x written) / time. Times are the best of n samples "
        "(n = copyto/fast/new, naive, fallback). `fast` = the compiled path (numba) writing into a gradX buffer "
        "the caller owns (`moe_init_routing_v2_grad(..., out=grad_x)`; as the operator does: aclnn writes into "
        "the caller's gradX); `new gradX` = the same "
        "call allocating its result (what `moe_init_routing_v2_grad` does: it adds the first touch of fresh "
        "pages); `fallback` = the NumPy path (no numba), into the caller's buffer; all three order ascend910b, "
        "bit-exact. `naive` = `grad_expanded_x.astype(float32)[idx.reshape(N, K)].sum(1)` (not bit-exact; "
        "skipped slots pointed at row 0 beforehand); its ratio is taken against `new gradX`, which allocates "
        "as it does. `gather` = the same rows read plainly: one load from every 64-byte line of each row "
        "the call reads, slot by slot in the kernel's order, on the kernel's threads, with no prefetch "
        "hints and nothing computed or written. `gather / fast` near 1 or above: the kernel takes about "
        "what its rows take to arrive (rows at random places arrive slower than copyto's two streams).",
        "",
        "| workload | shape | moved MiB | copyto GB/s | fast ms | fast GB/s | fast / copyto (>= 0.7) "
        "| gather ms | gather / fast | new gradX ms | fallback ms | naive ms | naive / new gradX (>= 3) "
        "| fallback / fast | n | fast == fallback bits |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in results:
        w, best, n = r["workload"], r["best"], r["samples"]
        copy_bw = 2 * _COPY_BYTES / best["copyto"]
        fast_bw = r["moved"] / best["fast"]
        ratio = fast_bw / copy_bw
        speedup = best["naive"] / best["fast_new"]
        fallback = best.get("fallback")
        fallback_ms = "-" if fallback is None else f"{fallback * 1e3:.0f}"
        fallback_ratio = "-" if fallback is None else f"{fallback / best['fast']:.1f}x"
        bits = "-" if r["same_bits"] is None else ("yes" if r["same_bits"] else "**NO**")
        bw_cell = f"{ratio:.2f} {_verdict(ratio >= _BANDWIDTH_SHARE) if w.name in _TARGET_BANDWIDTH else ''}".strip()
        naive_cell = f"{speedup:.1f}x {_verdict(speedup >= 3) if w.name in _TARGET_NAIVE else ''}".strip()
        gather = best.get("gather")
        gather_cells = "- | -" if gather is None else f"{gather * 1e3:.1f} | {gather / best['fast']:.2f}"
        lines.append(
            f"| {w.name} | {w.describe()} | {r['moved'] / mib:.0f} | {copy_bw / 1e9:.2f} | {best['fast'] * 1e3:.1f} "
            f"| {fast_bw / 1e9:.2f} | {bw_cell} | {gather_cells} | {best['fast_new'] * 1e3:.1f} | {fallback_ms} "
            f"| {best['naive'] * 1e3:.0f} | {naive_cell} | {fallback_ratio} "
            f"| {n['fast']}, {n['naive']}, {n.get('fallback', 0)} | {bits} |"
        )
    measured = [p for p in probes if p]
    if measured:
        lines += [
            "",
            "What the machine gave this run (before and after the workloads; best of 5 each): a pure read "
            "stream over 512 MiB with 1 and 2 threads, and the speedup of a compute-only loop on 2 threads "
            "over 1 (2.0 = both cores free; other engineers share this machine).",
            "",
            "| when | read stream, 1 thread GB/s | read stream, 2 threads GB/s | cores' worth of compute on 2 threads |",
            "|---|---:|---:|---:|",
        ]
        for when, p in zip(("before", "after"), probes):
            if p:
                lines.append(f"| {when} | {p['read1_gbs']:.2f} | {p['read2_gbs']:.2f} | {p['cores']:.2f} |")
        if min(p["cores"] for p in measured) < 1.5:
            lines += ["", "The compute probe did not get both cores in this run (other work was running). While the "
                      "kernel's two lanes share about one core, it reads memory at about one core's read-stream "
                      "rate (see the notes at the end of this file), which is below "
                      "half of what `copyto` counts, since copyto's writes count too: a bandwidth ratio under 0.5 "
                      "in such a run measures the machine's share more than the kernel."]
    lines += [
        "",
        "Peak memory beyond inputs and output (target: at most grad_x), one fresh process per row: after a "
        "warm-up call on tiny inputs (compile, pool threads), VmHWM after resetting it, minus the RSS before "
        "the call, minus grad_x (the call allocates it).",
        "",
        "| workload | path | extra peak MiB | grad_x MiB | result |",
        "|---|---|---:|---:|---|",
    ]
    for (name, kernel), m in memory.items():
        if "error" in m:
            lines.append(f"| {name} | {kernel} | error: {m['error']} | | **MISS** |")
            continue
        note = "" if m["reset"] else " (peak not reset: includes the warm-up)"
        if m["extra_bytes"] < 0:
            note += f" (RSS fell {-m['extra_bytes'] / mib:.1f} MiB)"
        lines.append(f"| {name} | {'fast' if kernel == 'numba' else 'fallback'} | {max(0, m['extra_bytes']) / mib:.1f}{note} "
                     f"| {m['grad_x_bytes'] / mib:.0f} | {_verdict(m['extra_bytes'] <= m['grad_x_bytes'])} |")
    lines += [
        "",
        "Threads: the compiled kernel releases the GIL; one lane per thread of the reference module's shared "
        "pool (`MOEGRAD_REFERENCE_THREADS`, default the usable CPUs, at most 8) takes spans of about 4 MiB of "
        "input until none is left. A service running two streams queues both calls' lanes on the same threads, "
        "so it never runs more compute threads than the pool has (why not numba's prange: the notes at the "
        "end of this file).",
    ]
    return "\n".join(lines)


def main(quick: bool = True, *, write: bool = True, workloads: tuple[str, ...] = ()) -> str:
    """Run the benchmark, print the section and (``write``) put it in bench/RESULTS.md; returns it."""
    started = time.monotonic()
    if not compiled_kernel_available():
        print("bench.kernel: numba is not installed; 'fast' below is the NumPy path", flush=True)
    machine_before = _machine()
    probes = [probe()]
    repeats, slow_repeats = (5, 1) if quick else (15, 3)
    chosen = [w for w in WORKLOADS if not workloads or w.name in workloads]
    results = []
    for w in chosen:
        print(f"bench.kernel: {w.name} {w.describe()} ...", flush=True)
        result = measure(w, repeats, slow_repeats)
        results.append({k: v for k, v in result.items() if k != "call"})
        del result
    memory: dict[tuple[str, str], dict] = {}
    for w in chosen:
        fast_kernel = "numba" if compiled_kernel_available() else "numpy"
        for kernel in (fast_kernel,) if quick else ("numba", "numpy")[:2 if compiled_kernel_available() else 1]:
            print(f"bench.kernel: peak memory {w.name} {kernel} ...", flush=True)
            memory[(w.name, kernel)] = peak_extra(w.name, kernel)
    probes.append(probe())
    load_after = "%.1f/%.1f/%.1f" % os.getloadavg()
    body = render(results, memory, quick, time.monotonic() - started, machine_before, load_after, probes)
    print(body, flush=True)
    if write:
        from bench._results import write_section

        write_section("kernel", body)
    return body


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True, help="fewer repetitions (default)")
    mode.add_argument("--full", dest="quick", action="store_false", help="more repetitions, memory of both paths")
    parser.add_argument("--workload", action="append", default=[], choices=[w.name for w in WORKLOADS],
                        help="run only these (repeatable); RESULTS.md is not written then")
    parser.add_argument("--memory", choices=[w.name for w in WORKLOADS], help=argparse.SUPPRESS)
    parser.add_argument("--kernel", choices=["numba", "numpy"], default="numba", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory:  # the subprocess of peak_extra()
        print(json.dumps(_memory_child(args.memory, args.kernel)))
        return 0
    main(quick=args.quick, write=not args.workload, workloads=tuple(args.workload))
    return 0


if __name__ == "__main__":
    from support.launch import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(_cli())
