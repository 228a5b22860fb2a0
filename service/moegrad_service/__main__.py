"""``moegrad-service serve [flags]`` / ``python -m moegrad_service serve``: run the service with uvicorn.

Each flag mirrors one setting (``--streams 4`` is ``MOEGRAD_STREAMS=4``); a flag given wins over the
environment. One process, one uvicorn worker, one device; with ``--grpc-port`` the same process also
serves protocol v2 over gRPC, on the same workers, draining with HTTP on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import signal
import socket
import sys
import threading
import typing
from pathlib import Path

from pydantic import ValidationError

from moegrad import __version__

try:
    from moegrad_service.settings import Settings
except ImportError:  # a client-only install (no service extra): main() says what to install
    Settings = None  # type: ignore[assignment,misc]

if typing.TYPE_CHECKING:
    from fastapi import FastAPI

    from moegrad_service.engine import Backend

__all__ = ["main"]

#: What serving imports beyond the client's packages: the ``service`` extra of pyproject.toml.
_SERVICE_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "prometheus_client")
_INSTALL_HINT = "pip install 'moegrad[service]'"


def _missing_service_modules() -> list[str]:
    missing = []
    for module in _SERVICE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def _port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None; checked before the backend warms up (which takes seconds)."""
    if port == 0:  # an ephemeral port is always free
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return (
            f"cannot listen on {host}:{port}: the host does not resolve ({exc.strerror}); check --host / MOEGRAD_HOST"
        )
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            probe.bind(address)
        except OSError as exc:
            return (
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; is another server running there? "
                "Stop it, or choose another port with --port / MOEGRAD_PORT"
            )
    return None


def _plain(text: str) -> str:
    """Help text as a terminal shows it: the docstrings' reStructuredText ``literals`` without their backquotes."""
    return text.replace("``", "")


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        options: dict = {"dest": name, "default": argparse.SUPPRESS}
        default = field.get_default(call_default_factory=True)
        help_text = f"{_plain(field.description or '')} (env MOEGRAD_{name.upper()}"
        help_text += ")" if default in (None, []) else f"; default {default})"
        if annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:
            options["choices"] = typing.get_args(annotation)
        elif name == "auth_tokens":
            options["metavar"] = "TOKEN[,TOKEN...]"
        elif annotation in (int, float):
            options["type"] = annotation
        elif Path in typing.get_args(annotation):
            options["metavar"] = "PATH"
        parser.add_argument(flag, help=help_text.replace("%", "%%"), **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegrad-service", description=_plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--version", action="version", version=f"moegrad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the service (one process, one device)",
        description="Run the moegrad service. Every flag mirrors a MOEGRAD_ setting.",
    )
    _add_setting_flags(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``moegrad-service`` command; 2 for bad settings or a missing service extra."""
    missing = _missing_service_modules() if Settings is not None else ["pydantic_settings"]
    if missing:
        print(
            f"moegrad-service: the service is not installed here (missing {', '.join(missing)}); "
            f"install it with: {_INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    try:
        settings = Settings(**args)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(map(str, error["loc"])) or "settings"
            print(f"moegrad-service: invalid setting {where}: {error['msg']}", file=sys.stderr)
        return 2
    return serve(settings)


def serve(settings: Settings, *, backend: Backend | None = None) -> int:
    """Run uvicorn with one worker until SIGINT/SIGTERM; 0 on a clean stop, 1 if the server never
    started (the port is taken, checked before anything warms up; when the app's own startup fails,
    e.g. no device, uvicorn exits with status 3 itself).

    ``backend`` serves instead of the one ``settings.backend`` names (tests pass a slowed or faulty
    one; see :func:`moegrad_service.app.create_app`).
    """
    import uvicorn

    from moegrad_service.app import create_app
    from moegrad_service.memory import map_large_allocations

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    problem = _port_problem(settings.host, settings.port)
    if problem is not None:
        print(f"moegrad-service: {problem}", file=sys.stderr)
        return 1
    try:
        app = create_app(settings, backend=backend)
    except (OSError, ValueError) as exc:  # an unreadable or empty token file
        print(f"moegrad-service: {exc}", file=sys.stderr)
        return 2

    from moegrad_service.connections import DrainingServer, guarded_protocol

    protocol = guarded_protocol(max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s)
    _raise_fd_limit(settings.max_connections)
    map_large_allocations()

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        http=protocol,
        log_level=settings.log_level,
        access_log=False,
        ssl_certfile=str(settings.tls_certfile) if settings.tls_certfile else None,
        ssl_keyfile=str(settings.tls_keyfile) if settings.tls_keyfile else None,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 1,
        timeout_keep_alive=settings.idle_timeout_s,
        limit_concurrency=settings.max_connections,
        log_config=None,
    )
    server = DrainingServer(
        config, protocol=protocol, drain_s=settings.shutdown_drain_s, on_drain=functools.partial(_stop_admitting, app)
    )

    def after_drain(signum: int, frame: object) -> None:
        # uvicorn, once its graceful shutdown is done, restores the SIGTERM / SIGINT handler it found
        # and raises the signal again (so that the default action would end the process as -SIGTERM,
        # or Python's raise KeyboardInterrupt with a traceback). A drained stop is a clean stop: let
        # it return 0. Before uvicorn has started, stop at once.
        if not server.has_started():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, after_drain) for signum in stops} if in_main_thread else {}
    try:
        server.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0 if server.has_started() else 1


#: File descriptors kept beyond max_connections: the listener, logs, the device, the worker threads' files.
_SPARE_FDS = 64


def _raise_fd_limit(max_connections: int) -> None:
    """Raise the soft open-file limit to the hard one, and warn when it still cannot hold
    ``max_connections``: at the limit the kernel's accept fails and a new client is closed unanswered."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and max_connections + _SPARE_FDS > soft:
        logging.getLogger("moegrad_service").warning(
            "max_connections=%d does not fit the open-file limit of %d (with %d spare); clients beyond the "
            "limit are closed unanswered: lower max_connections or raise the limit (ulimit -n)",
            max_connections,
            soft,
            _SPARE_FDS,
        )


def _stop_admitting(app: FastAPI) -> None:
    """The app stops admitting calls (``app.state.drain``, set once its lifespan has started)."""
    drain = getattr(app.state, "drain", None)
    if drain is not None:
        drain()


if __name__ == "__main__":
    sys.exit(main())
