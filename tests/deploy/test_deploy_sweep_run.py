"""The rendered sweep Jobs run as Kubernetes would run them, against three servers behind one name.

This module plays the cluster: the headless Service's name resolves to three ready pods (three
reference servers on 127.0.0.1, 127.0.0.2 and 127.0.0.3, one port: on Linux all of 127.0.0.0/8 is
loopback) and a fourth that died and is still listed (127.0.0.4, where nothing listens: each run
names it lost); each index runs the rendered sweep Job's ``moegrad`` arguments with
``$(JOB_COMPLETION_INDEX)`` expanded as the kubelet expands it, then the merge Job's, in this
process (``moegrad.cli._main.main``). Only what a cluster changes is changed: the mounts' paths become
folders here and the URL's port the servers' (the scheme and the Service's name are the Job's).
The name resolves through ``socket.getaddrinfo``, which the client calls for a ``dns+`` URL
(docs/accuracy.md, "Sweeps"): replaced here for the Service's name alone, every other name and
address resolved as before.

Oracles: each case's status from tests/support/oracle.py (a K=2 float32 call's device result is one
float32 add); what each server judged from its own ``/metrics`` (its calls answered, by endpoint);
the exit statuses as README.md lists them (the sweep Job's pods 0 once every case is judged,
issue 38; the merge 4 while a shard has no file, then 1 when a case failed); each case's dtype,
shape, K and mode as the test wrote it.
"""

from __future__ import annotations

import csv
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from deploy._manifests import expand, kustomize, option
from moegrad import accuracy
from moegrad.cli._main import main
from support.launch import ServerNotReady, free_port, moegrad_server
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "deploy" / "sweep"
#: The three ready pods of the headless Service ...
PODS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
#: ... and one that died, still in its answer.
DEAD = "127.0.0.4"
CASES = 200
ANSWERED = re.compile(r'^moegrad_inference_request_success_total\{endpoint="([^"]*)"\} (\S+)$', re.M)
FAILED = re.compile(r'^moegrad_inference_request_failure_total\{[^}]*\} (\S+)$', re.M)


def _free_everywhere() -> int:
    """A port free on every pod address a moment ago."""
    for _ in range(20):
        port = free_port(PODS[0])
        try:
            for address in PODS[1:]:
                with socket.socket() as sock:
                    sock.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """Three reference servers, one per address, on one port; stopped at the end."""
    log_dir = tmp_path_factory.mktemp("pods")
    for attempt in range(3):
        port = _free_everywhere()
        with ThreadPoolExecutor(len(PODS)) as pool:
            started = list(pool.map(_start, [log_dir] * len(PODS), PODS, [port] * len(PODS)))
        servers = [server for server in started if not isinstance(server, Exception)]
        if len(servers) == len(PODS):
            break
        for server in servers:
            server.stop()
        if attempt == 2:
            raise next(server for server in started if isinstance(server, Exception))
    try:
        yield port, servers
    finally:
        for server in servers:
            server.stop()


def _start(log_dir: Path, address: str, port: int):
    try:
        return moegrad_server(log_dir, host=address, port=port, name=f"pod-{address}", ready_within_s=120.0)
    except ServerNotReady as exc:  # another process took the port on one address: the fixture tries another
        return exc


def _job(directory: Path) -> tuple[dict, int]:
    """The rendered Job's container and its number of indexes."""
    (job,) = [r for r in kustomize(directory) if r["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container, job["spec"].get("completions", 1)


def _here(args: list[str], container: dict, folders: dict[str, Path], port: int) -> list[str]:
    """The container's args with each mount's path a folder here and the URL's port the servers'."""
    mounts = {m["mountPath"]: folders[m["name"]] for m in container["volumeMounts"] if m["name"] in folders}
    moved = []
    for arg in args:
        for mount, folder in mounts.items():
            if arg == mount or arg.startswith(mount + "/"):
                arg = str(folder) + arg[len(mount):]
        moved.append(arg)
    if "--url" in moved:
        at = moved.index("--url") + 1
        url = urlsplit(moved[at])
        moved[at] = url._replace(netloc=f"{url.hostname}:{port}").geturl()
    return moved


def _write_cases(folder: Path) -> dict[str, str]:
    """CASES case files (every 7th scaled by 1 + 2^-12) -> the oracle's status."""
    folder.mkdir()
    expected = {}
    for i in range(CASES):
        call = oracle_call(seed=i, tokens=8, hidden=16)
        candidate = oracle_candidate("scaled_up" if i % 7 == 3 else "device", device_k2(call))
        accuracy.save_case(folder / f"case{i:04d}.npz", grad_expanded_x=call.grad_expanded_x,
                           expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
        golden, scale = golden_and_scale(call)
        statuses = float32_statuses(candidate, device_k2(call), golden, scale)
        failed = any(status == "fail" for name, status in statuses.items() if name != "bitwise")
        expected[f"case{i:04d}"] = "fail" if failed else "pass"
    assert "fail" in expected.values()
    return expected


def _answered(address: str, port: int) -> tuple[float, float]:
    """The calls a server answered with a result, and with an error (its /metrics)."""
    text = httpx.get(f"http://{address}:{port}/metrics", timeout=10).text
    return (sum(float(count) for _, count in ANSWERED.findall(text)),
            sum(float(count) for count in FAILED.findall(text)))


def test_the_sweep_job_reaches_every_ready_pod_and_completes_with_findings(pods, tmp_path, monkeypatch, capsys):
    port, _ = pods
    (sweep, completions), (merge, _) = _job(SWEEP), _job(SWEEP / "merge")
    service = urlsplit(option(sweep["args"], "--url")).hostname
    resolve = socket.getaddrinfo

    def headless(host, port_, *args, **kwargs):  # the cluster DNS's answer: one A record per pod listed
        if host == service:
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (pod, int(port_)))
                    for pod in (*PODS, DEAD)]
        return resolve(host, port_, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", headless)
    for name in ("MOEGRAD_URL", "MOEGRAD_TOKEN"):  # the Job's token Secret is optional and absent here
        monkeypatch.delenv(name, raising=False)
    folders = {"cases": tmp_path / "cases", "results": tmp_path / "results"}
    expected = _write_cases(folders["cases"])
    folders["results"].mkdir()
    before = [_answered(pod, port) for pod in PODS]
    assert sweep["command"] == ["moegrad"] and merge["command"] == ["moegrad"]
    for index in range(completions):
        args = [expand(arg, {"JOB_COMPLETION_INDEX": str(index)}) for arg in sweep["args"]]
        assert main(_here(args, sweep, folders, port)) == 0, f"index {index}: {capsys.readouterr()}"
        # the dead pod, named once by each index's run, on its console and in its summary beside its results
        err = capsys.readouterr().err
        assert f"moegrad: replica http://{DEAD}:{port} lost (no answer since it failed): " in err, err
        assert f"- replica http://{DEAD}:{port} lost" in (folders["results"] / f"shard-{index}.summary.md").read_text()
        if index == completions - 2:  # one shard left: the merge says first what is missing, and exits 4
            assert main(_here(merge["args"], merge, folders, port)) == 4
            summary = Path(_here([option(merge["args"], "--summary")], merge, folders, port)[0])
            lines = summary.with_suffix(".md").read_text().splitlines()
            assert lines[2].startswith("**Not complete: ") and lines[4].startswith(f"- shard {index + 1} (no file)")
            capsys.readouterr()
    assert not list(folders["cases"].glob("summary*"))  # the pods write nothing where the cases are (read-only)
    after = [_answered(pod, port) for pod in PODS]
    served = [now[0] - then[0] for now, then in zip(after, before, strict=True)]
    assert all(count > 0 for count in served), f"calls per pod {dict(zip(PODS, served, strict=True))}"
    assert sum(served) == CASES and all(now[1] == then[1] for now, then in zip(after, before, strict=True))
    capsys.readouterr()
    assert main(_here(merge["args"], merge, folders, port)) == 1  # a case failed: the merge says so
    out = capsys.readouterr().out
    failing = sorted(name for name, status in expected.items() if status == "fail")
    assert f"{CASES} cases against {completions} shard files of {completions}" in out
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("  fail ")) == failing
    summary = Path(_here([option(merge["args"], "--summary")], merge, folders, port)[0])
    assert summary.with_suffix(".csv").is_file() and summary.with_suffix(".md").is_file()
    # the triage columns: what each case is, the device's own status beside the candidate's
    with open(summary.with_suffix(".csv"), encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    assert sorted(row["API Name"] for row in rows[:len(failing)]) == failing  # the failures first
    assert {(row["DEVICE Dtype"], row["Shape"], row["top_k"], row["mode"], row["active_num"]) for row in rows} == {
        ("float32", "(8, 16)", "2", "dropless", "0")}
    assert {row["device_status"] for row in rows} == {"pass"}
    policy = "Policy: standards dual_thousandth, threshold, benchmark, accumulative;"
    assert policy in summary.with_suffix(".md").read_text()
