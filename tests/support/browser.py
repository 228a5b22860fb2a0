"""A real headless browser for the HTML report tests: Debian's chromium, driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: JSON messages ending in a NUL byte on file
descriptors 3 and 4, as Puppeteer's pipe transport speaks it), with nothing but the standard library.

:func:`find_chromium` returns the browser's path, installing the Debian package ``chromium`` with
apt-get when it is missing and the tests run as root (the test setup of docs/accuracy.md, "A page
to look at"); it returns None, with the reason, when it cannot. :func:`load` opens one page and
returns what a reader would see and everything the browser complained about.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Loaded", "find_chromium", "load"]

_NAMES = ("chromium", "chromium-browser")
_INSTALL_TIMEOUT_S = 600


def find_chromium() -> tuple[str | None, str]:
    """(path, "") of a chromium, installed with apt-get when missing; (None, why) when there is none."""
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found, ""
    if os.geteuid() != 0:
        return None, "chromium is not installed and the tests do not run as root: apt-get install -y chromium"
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, env=environment)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"apt-get could not install chromium: {exc}"
        if done.returncode:
            return None, f"apt-get could not install chromium (is the package mirror reachable?): {done.stderr[-500:]}"
    found = shutil.which("chromium")
    return (found, "") if found else (None, "apt-get installed chromium, but no chromium is on PATH")


@dataclass
class Loaded:
    """One page as the browser loaded it.

    Attributes:
        value: what the page's probe expression returned (a JSON value).
        errors: console errors, uncaught exceptions and the browser's error log entries.
        requests: every URL the page asked for (the page itself included).
        failed: requests that failed.
    """

    value: Any
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class _Pipe:
    def __init__(self, browser: str, profile: str) -> None:
        ours_read, theirs_write = os.pipe()
        theirs_read, ours_write = os.pipe()

        def descriptors() -> None:  # the child's fd 3 reads our messages, fd 4 writes its own
            read, write = os.dup(theirs_read), os.dup(theirs_write)
            os.dup2(read, 3)
            os.dup2(write, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                   "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}", "about:blank"]
        self.process = subprocess.Popen(command, preexec_fn=descriptors, close_fds=False,  # noqa: PLW1509
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(theirs_read)
        os.close(theirs_write)
        self.out = os.fdopen(ours_write, "wb", buffering=0)
        self.into = os.fdopen(ours_read, "rb", buffering=0)
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.out.write(json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def receive(self) -> dict:
        while b"\0" not in self.buffer:
            chunk = self.into.read(1 << 16)
            if not chunk:
                raise EOFError("the browser closed its pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def wait_for(self, method: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(event.get("method") == method for event in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout_s} s")
            self.events.append(self.receive())

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (OSError, EOFError, RuntimeError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.out.close()
        self.into.close()


def load(browser: str, page: Path, probe: str, *, timeout_s: float = 30.0) -> Loaded:
    """Open ``page`` (a file) in a fresh headless browser, wait for its load event, and evaluate
    ``probe`` (a JavaScript expression, by the DevTools protocol: the page itself holds no script)."""
    with tempfile.TemporaryDirectory() as profile:
        pipe = _Pipe(browser, profile)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime.enable", "Log.enable", "Page.enable", "Network.enable"):
                pipe.send(domain, session=session)
            pipe.events.clear()
            pipe.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            pipe.wait_for("Page.loadEventFired", timeout_s)
            value = pipe.send("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=session)
            loaded = Loaded(value.get("result", {}).get("value"))
            for event in pipe.events:
                method, params = event.get("method"), event.get("params", {})
                if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
                    loaded.errors.append(f"console {params['type']}: {params.get('args')}")
                elif method == "Runtime.exceptionThrown":
                    loaded.errors.append(f"exception: {params.get('exceptionDetails')}")
                elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                    loaded.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
                elif method == "Network.requestWillBeSent":
                    loaded.requests.append(params["request"]["url"])
                elif method == "Network.loadingFailed":
                    loaded.failed.append(f"{params.get('errorText')} {params.get('requestId')}")
            return loaded
        finally:
            pipe.close()
