"""The client against a hostile server: ``python -m bench.client_attacks [--client DIR] [ATTACK ...]``.

Each attack runs one call of ``moegrad.Client`` (or ``AsyncClient``) in a fresh child process
against ``support.hostile``'s server (a thread of this process, so its memory is not the
client's), and prints a row: the client's resident memory before the call and at its peak
(``VmRSS`` / ``VmHWM`` of /proc/self/status), the call's wall time, and how it ended.

``--client DIR`` imports moegrad from another checkout's ``client`` folder (``git archive <commit>
client | tar -x -C DIR/..``), to measure the same attacks before a change; the child prints which
moegrad it ran. The attacks, at the size of the original finding:

- ``huge``: a 1 GiB reply (Content-Length declared) to the documentation's example (grad_x of 16 bytes);
- ``huge-chunked``: the same, chunked (no length known in advance);
- ``bomb``: a 20 MB msgpack bomb (empty lists) answering a call whose grad_x is 20 MiB;
- ``detail``: a 422 problem document whose ``detail`` is 512 MiB;
- ``frames``: a frames header claiming a 4 PiB grad_x;
- ``drip`` / ``drip-async``: ``timeout_s=5`` against a reply dripped a byte every 2 s (its head
  and 60 bytes of body);
- ``zip-bomb`` / ``sparse``: ``moegrad compare --local --cases DIR`` (the sweep, in the child) over
  one case file whose ``candidate`` member is not an .npy array and inflates to ``--bomb-gib`` GiB
  of zeros (about a thousandth of that on disk), or one extended to ``--sparse-gib`` GiB by a hole;
- ``names``: the same sweep (``--summary``, ``--verbose``) over cases named as spreadsheet formulas
  (``=``, ``+``, ``-``, ``@`` first), a name holding a newline and a markdown row saying "pass", and
  one of terminal escapes that erase the line above: the outcome counts the summary CSV's name
  cells a spreadsheet reads as formulas, the summary markdown's table rows beyond one per case, and
  the escape bytes the console was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from support.hostile import Answer, HostileServer, drip, flood, frames_claiming, head, msgpack_bomb, whole

__all__ = ["ATTACKS", "main"]

GIB, MIB = 1 << 30, 1 << 20
ORDER = "ascend910b@9.1"
FRAMES = "application/vnd.moegrad.frames"


def _detail() -> Answer:
    """A 422 whose detail is 512 MiB, its head and body sent apart (the body built once)."""
    body = b'{"title": "Invalid argument", "status": 422, "aclnn_status": 161002, "detail": "%s"}' % (
        b"x" * (512 * MIB)
    )
    return lambda connection, server: (
        server.send(connection, head(422, "application/problem+json", len(body))),
        server.send(connection, body),
    )


#: attack -> (its description, the server's answer (built when the attack runs), the child's call).
ATTACKS = {
    "huge": ("1 GiB reply (Content-Length) to a 16-byte grad_x", lambda: flood(head(length=GIB), GIB), "doc"),
    "huge-chunked": ("1 GiB chunked reply to a 16-byte grad_x", lambda: flood(head(), GIB, chunked=True), "doc"),
    "bomb": (
        "20 MB msgpack bomb to a call of 20 MiB",
        lambda: (lambda body: whole(head(length=len(body)) + body))(msgpack_bomb(256, 256, 300)),
        "large",
    ),
    "detail": ("422 with a 512 MiB detail", _detail, "doc"),
    "frames": (
        "frames header claiming 4 PiB",
        lambda: (lambda body: whole(head(content_type=FRAMES, length=len(body)) + body))(
            frames_claiming([1 << 40, 1 << 10])
        ),
        "doc",
    ),
    "drip": ("timeout_s=5, a byte every 2 s (sync)", lambda: drip(head(length=60) + bytes(60), 2.0), "doc"),
    "drip-async": ("timeout_s=5, a byte every 2 s (async)", lambda: drip(head(length=60) + bytes(60), 2.0), "async"),
}


def _memory() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _case_members() -> dict[str, np.ndarray]:
    return {
        "grad_expanded_x": np.ones((4, 2), np.float32),
        "expanded_row_idx": np.arange(4, dtype=np.int32),
        "candidate": np.ones((2, 2), np.float32),
        "top_k": np.array(2, np.int64),
    }


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array)
    return buffer.getvalue()


def zip_bomb_case(folder: Path, gib: float) -> None:
    """bomb.npz: a good case but for ``candidate``, a member without .npy of ``gib`` GiB of zeros, deflated."""
    with zipfile.ZipFile(folder / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in _case_members().items():
            if name != "candidate":
                archive.writestr(f"{name}.npy", _npy(array))
        with archive.open("candidate", "w", force_zip64=True) as member:
            block = bytes(MIB)
            for _ in range(int(gib * 1024)):
                member.write(block)


def sparse_case(folder: Path, gib: float) -> None:
    """sparse.npz: a good case file extended to ``gib`` GiB by a hole."""
    np.savez(folder / "sparse.npz", **_case_members())
    os.truncate(folder / "sparse.npz", int(gib * GIB))


#: Case names that are spreadsheet formulas, forge a markdown row, or erase a console line.
HOSTILE_NAMES = ['=HYPERLINK("x","pass")', "+SUM(1,1)", "-2+3", "@SUM(A1)", "quiet\n| all_good | pass |",
                 "\x1b[2K\x1b[1Aall cases pass"]


def names_case(folder: Path, gib: float) -> None:
    """One good case file under each of HOSTILE_NAMES (``gib`` unused)."""
    for name in HOSTILE_NAMES:
        np.savez(folder / f"{name}.npz", **_case_members())


#: case attack -> (its description with the size, the builder of its folder).
CASE_ATTACKS = {
    "zip-bomb": ("a .npz whose non-.npy member inflates to {gib} GiB, swept", zip_bomb_case),
    "sparse": ("a {gib} GiB sparse .npz, swept", sparse_case),
    "names": ("6 cases named as formulas, a forged markdown row, terminal escapes, swept", names_case),
}


def _inert(folder: str, console: str) -> str:
    """What the sweep's outputs let through of HOSTILE_NAMES: formula cells, forged rows, escape bytes."""
    import csv

    with open(f"{folder}/s.csv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    formulas = sum(1 for row in rows for key in ("API Name", "file") if (row.get(key) or "")[:1] in "=+-@\t\r"
                   and row.get(key))
    table = [line for line in Path(f"{folder}/s.md").read_text().splitlines() if line.startswith("|")]
    forged = len(table) - 2 - len(HOSTILE_NAMES)
    return f"formula cells {formulas}, forged markdown rows {forged}, escape bytes on the console {console.count(chr(27))}"


def cases_child(folder: str) -> None:
    """``moegrad compare --local --cases folder`` in this process; prints a JSON line as :func:`child` does."""
    import moegrad

    try:
        from moegrad.cli import main
    except ImportError:  # a checkout from before the client's wings (--client): its CLI is moegrad._cli
        main = importlib.import_module("moegrad._cli").main

    import contextlib

    named = (Path(folder) / f"{HOSTILE_NAMES[0]}.npz").exists()
    console = io.StringIO()
    before = _memory()["VmRSS"]
    began = time.monotonic()
    try:
        with contextlib.redirect_stdout(console):
            status = main(["compare", "--local", "--cases", folder, "--no-progress", "--summary", f"{folder}/s",
                           *(["--verbose"] if named else [])])
        outcome = f"exit {status}" + (f": {_inert(folder, console.getvalue())}" if named else "")
    except BaseException as exc:  # what the sweep ends with is the measurement
        outcome = f"{type(exc).__name__}: {str(exc)[:90]}"
    took = time.monotonic() - began
    print(
        json.dumps(
            {"moegrad": moegrad.__file__, "rss": before, "peak": _memory()["VmHWM"], "s": took, "outcome": outcome}
        )
    )


def child(url: str, call: str) -> None:
    """One call against ``url``; prints a JSON line: moegrad's path, memory before and at the peak, time, outcome."""
    import numpy as np

    import moegrad

    if call == "large":  # grad_x [5120, 1024] float32: 20 MiB, so a 20 MB bomb fits what the call can produce
        x, idx, top_k = np.zeros((5120, 1024), np.float32), np.arange(5120, dtype=np.int32), 1
    else:
        x = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], np.float32)
        idx, top_k = np.array([2, 0, 1, 3], np.int32), 2
    options = {"timeout_s": 5.0 if call != "large" else 600.0, "retries": 0, "wire": "msgpack"}
    before = _memory()["VmRSS"]
    began = time.monotonic()
    try:
        if call == "async":

            async def run() -> None:
                async with moegrad.AsyncClient(url, **options) as client:
                    await client.moe_init_routing_v2_grad(x, idx, top_k, order=ORDER)

            asyncio.run(run())
        else:
            with moegrad.Client(url, **options) as client:
                client.moe_init_routing_v2_grad(x, idx, top_k, order=ORDER)
        outcome = "returned"
    except BaseException as exc:  # what the call ends with is the measurement
        outcome = f"{type(exc).__name__} ({len(str(exc))} chars): {str(exc)[:90]}"
    took = time.monotonic() - began
    print(
        json.dumps(
            {"moegrad": moegrad.__file__, "rss": before, "peak": _memory()["VmHWM"], "s": took, "outcome": outcome}
        )
    )


def _child(arguments: list[str], client_dir: str | None) -> dict[str, object]:
    env = dict(os.environ)
    if client_dir:
        env["PYTHONPATH"] = os.pathsep.join([client_dir, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "bench.client_attacks", *arguments],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        return {"outcome": f"child failed ({done.returncode}): {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def run(name: str, client_dir: str | None, sizes: dict[str, float]) -> dict[str, object]:
    if name in CASE_ATTACKS:
        description, build = CASE_ATTACKS[name]
        gib = sizes.get(name, 0.0)
        with tempfile.TemporaryDirectory() as folder:
            build(Path(folder), gib)
            return {
                "attack": description.format(gib=f"{gib:g}"),
                "sent": 0,
                **_child(["--cases-child", folder], client_dir),
            }
    description, answer, call = ATTACKS[name]
    with HostileServer(answer()) as server:
        row = _child(["--child", server.url, call], client_dir)
        sent = server.sent
    return {"attack": description, "sent": sent, **row}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.client_attacks", description=__doc__.splitlines()[0])
    names = [*ATTACKS, *CASE_ATTACKS]
    parser.add_argument("attacks", nargs="*", metavar="ATTACK", help=f"of {', '.join(names)}; default: every one")
    parser.add_argument("--bomb-gib", type=float, default=3.0, help="what the zip bomb inflates to (default 3)")
    parser.add_argument("--sparse-gib", type=float, default=8.0, help="the sparse file's length (default 8)")
    parser.add_argument("--client", help="import moegrad from this client folder (another checkout's)")
    parser.add_argument("--child", nargs=2, metavar=("URL", "CALL"), help=argparse.SUPPRESS)
    parser.add_argument("--cases-child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return
    if args.cases_child:
        cases_child(args.cases_child)
        return
    unknown = [name for name in args.attacks if name not in names]
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r}; the attacks are {', '.join(names)}")
    sizes = {"zip-bomb": args.bomb_gib, "sparse": args.sparse_gib}
    print("| attack | client RSS before -> peak | server sent | wall | outcome |")
    print("|---|---|---|---|---|")
    for name in args.attacks or names:
        row = run(name, args.client, sizes)
        if "peak" not in row:
            print(f"| {row.get('attack', name)} | - | - | - | {row['outcome']} |", flush=True)
            continue
        print(
            f"| {row['attack']} | {row['rss'] / MIB:.0f} -> {row['peak'] / MIB:.0f} MiB | "
            f"{row['sent'] / MIB:.1f} MiB | {row['s']:.1f} s | {str(row['outcome']).replace('|', '/')} |",
            flush=True,
        )
        print(f"moegrad: {row['moegrad']}", file=sys.stderr)


if __name__ == "__main__":
    main()
