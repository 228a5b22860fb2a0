"""The walk of one v1 call through the service, as a reader follows it: the files entered, and the
returns to a file already left; and the modules in each folder of the service package.

A server on the reference backend (uvicorn with the service's guarded protocol, as ``moegrad-service
serve`` runs it) answers one warm-up call, then the same call again while every thread's profiler
records each function of ``moegrad_service`` the first time it runs. Read in that order, one
function at a time, the functions' files make the walk: a step to another file that was already
visited is a return. A call whose body arrived with its head and one read in place take different
paths through ``connections``: the most frequent walk of ``--runs`` fresh servers is reported.

Usage: ``python -m bench.service_walk [--size small|large] [--runs 5]`` (small: the documentation's
example, 4 x 2 float32; large: 8192 x 512 float32, 16 MiB, read in place and written into a kept
buffer). Issue 36's closing note compares its figures before and after.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def _modules_per_folder(package: Path) -> dict[str, int]:
    return {
        str(folder.relative_to(package.parent)): len(list(folder.glob("*.py")))
        for folder in sorted([package, *(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")])
    }


def _one_walk(size: str) -> dict:
    import uvicorn

    import moegrad
    import moegrad_service
    from moegrad_service.app import create_app
    from moegrad_service.connections import guarded_protocol
    from moegrad_service.settings import Settings

    package = str(Path(moegrad_service.__file__).parent) + "/"
    first: dict[tuple[str, int, str], None] = {}
    armed = threading.Event()
    lock = threading.Lock()

    def profile(frame, event, arg):  # sys.setprofile's signature
        if event != "call" or not armed.is_set():
            return
        code = frame.f_code
        if code.co_filename.startswith(package):
            with lock:
                first.setdefault((code.co_filename[len(package) :], code.co_firstlineno, code.co_name), None)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings(backend="reference", port=port, warm_up=False, log_level="warning")
    protocol = guarded_protocol(max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s)
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, http=protocol, log_level="warning", log_config=None
    )
    server = uvicorn.Server(config)
    threading.setprofile(profile)  # every thread the server starts from here on
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    if size == "small":
        grad = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], np.float32)
        idx = np.array([2, 0, 1, 3], np.int32)
    else:
        rng = np.random.default_rng(0)
        grad = rng.standard_normal((8192, 512)).astype(np.float32)
        idx = rng.permutation(8192).astype(np.int32)
    with moegrad.Client(f"http://127.0.0.1:{port}") as client:
        client.moe_init_routing_v2_grad(grad, idx, top_k=2)  # warm: imports, pools, buffers
        armed.set()
        sys.setprofile(profile)
        client.moe_init_routing_v2_grad(grad, idx, top_k=2)
        time.sleep(0.2)  # the answer's release after the send
        armed.clear()
        sys.setprofile(None)
    server.should_exit = True
    thread.join(10)
    files = [name for name, _, _ in first]
    walk = [name for i, name in enumerate(files) if i == 0 or files[i - 1] != name]
    return {
        "functions": len(first),
        "files": len(set(walk)),
        "returns": len(walk) - len(set(walk)),
        "walk": walk,
        "modules": _modules_per_folder(Path(package)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run in a fresh process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one_walk(args.size)))
        return
    command = [sys.executable, "-m", "bench.service_walk", "--one", "--size", args.size]
    runs = [
        json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout) for _ in range(args.runs)
    ]
    counts = collections.Counter((run["files"], run["returns"], run["functions"]) for run in runs)
    (files, returns, functions), seen = counts.most_common(1)[0]
    walk = next(
        run["walk"] for run in runs if (run["files"], run["returns"], run["functions"]) == (files, returns, functions)
    )
    print(
        f"one v1 call ({args.size}), {seen} of {args.runs} runs: {files} files entered, {returns} returns to a "
        f"file already left ({functions} functions)"
    )
    print("  " + " -> ".join(walk))
    print("modules per folder: " + ", ".join(f"{folder} {count}" for folder, count in runs[0]["modules"].items()))
    others = sorted(set(counts) - {(files, returns, functions)})
    if others:
        print("other runs (files, returns, functions): " + ", ".join(map(str, others)))


if __name__ == "__main__":
    main()
