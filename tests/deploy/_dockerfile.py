"""Parse a Dockerfile and replay its build steps on this machine, without a Docker engine.

``parse`` reads the instructions (parser directives, comments, line continuations, JSON and shell
forms, ``--flag=value`` options). ``replay`` then runs one target stage and the stages it copies
from the way ``docker build`` (BuildKit) would, those stages concurrently with the target's own
steps, with these differences, each of which the caller controls:

- every ``FROM`` stands for one *base environment* (``base_env``: the variables of the base image,
  e.g. a clean virtual environment's ``bin`` first on ``PATH``);
- every path the build writes (``WORKDIR``, ``COPY`` destinations) must lie under ``sandbox``:
  a Dockerfile writes there when its paths come from build arguments that the caller overrides
  (``docker build --build-arg``), and ``replay`` refuses any other path (``SandboxEscape``);
- ``RUN`` runs ``/bin/sh -c`` in the stage's working directory with the stage's environment (its
  ``ENV`` plus its ``ARG`` values, as Docker does); ``skip_run`` may decline steps that need root
  (creating a user): they are recorded, not run;
- ``USER``, ``EXPOSE``, ``HEALTHCHECK``, ``ENTRYPOINT`` and ``CMD`` are recorded for the caller;
  ``COPY --chown`` is ignored (no root), ``--chmod`` is applied.

The build context honours ``.dockerignore`` (``dockerignore_excludes``). Anything this module does
not implement raises ``UnsupportedInstruction`` rather than being skipped silently.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

__all__ = [
    "Dockerfile",
    "Instruction",
    "SandboxEscape",
    "Stage",
    "StageResult",
    "UnsupportedInstruction",
    "dockerignore_excludes",
    "parse",
    "replay",
    "substitute",
]


class UnsupportedInstruction(ValueError):
    """The Dockerfile uses an instruction or option that ``replay`` does not implement."""


class SandboxEscape(ValueError):
    """A build step would write outside the sandbox directory."""


@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    flags: dict[str, str]  # --name=value options before the arguments
    args: str  # the arguments as written (shell form), after the flags
    exec_form: list[str] | None  # the JSON array, for the exec form
    line: int  # 1-based line of the instruction's first line


@dataclass
class Stage:
    base: str  # the FROM image as written, e.g. ${BASE_IMAGE}
    name: str | None
    instructions: list[Instruction]
    line: int


@dataclass
class Dockerfile:
    directives: dict[str, str]  # parser directives: syntax, escape, check
    global_args: list[Instruction]  # ARG instructions before the first FROM
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}")


@dataclass
class StageResult:
    name: str | None
    base: str  # the FROM image after substitution
    env: dict[str, str]  # the final environment (base_env with the stage's ENV applied)
    args: dict[str, str]  # the stage's ARG values
    workdir: Path | None
    user: str | None = None
    expose: list[str] = field(default_factory=list)
    healthcheck: Instruction | None = None
    entrypoint: Instruction | None = None
    cmd: Instruction | None = None
    skipped_runs: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)


_FLAG = re.compile(r"--([a-z][a-z-]*)=(\S*)")


def parse(text: str) -> Dockerfile:
    """Parse Dockerfile ``text``.

    Raises:
        UnsupportedInstruction: an escape character other than ``\\``, heredocs, or an instruction
            before the first FROM other than ARG.
    """
    lines = text.splitlines()
    directives: dict[str, str] = {}
    index = 0
    while index < len(lines):  # parser directives: "# key=value" lines at the very top
        match = re.fullmatch(r"#\s*([a-zA-Z]+)\s*=\s*(.*?)\s*", lines[index])
        if not match:
            break
        directives[match.group(1).lower()] = match.group(2)
        index += 1
    if directives.get("escape", "\\") != "\\":
        raise UnsupportedInstruction("only the default escape character is supported")

    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(lines[index:], start=index + 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments, also inside a continuation, and blank lines vanish
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        instructions.append(_instruction(" ".join(part.strip() for part in pending if part.strip()), start))
        pending = []
    if pending:
        raise UnsupportedInstruction(f"line {start}: the file ends inside a continuation")

    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            if len(words) == 3 and words[1].lower() == "as":
                stages.append(Stage(words[0], words[2], [], instruction.line))
            elif len(words) == 1:
                stages.append(Stage(words[0], None, [], instruction.line))
            else:
                raise UnsupportedInstruction(f"line {instruction.line}: FROM {instruction.args}")
        elif not stages:
            if instruction.keyword != "ARG":
                raise UnsupportedInstruction(f"line {instruction.line}: {instruction.keyword} before FROM")
            global_args.append(instruction)
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(directives, global_args, stages)


def _instruction(text: str, line: int) -> Instruction:
    keyword, _, rest = text.partition(" ")
    keyword = keyword.upper()
    rest = rest.strip()
    if "<<" in rest and keyword in {"RUN", "COPY", "ADD"}:
        raise UnsupportedInstruction(f"line {line}: heredocs are not supported")
    flags: dict[str, str] = {}
    if keyword in {"FROM", "RUN", "COPY", "ADD", "HEALTHCHECK"}:
        while match := _FLAG.match(rest):
            flags[match.group(1)] = match.group(2)
            rest = rest[match.end():].lstrip()
    exec_form = None
    if keyword == "HEALTHCHECK" and rest.upper().startswith("CMD "):
        rest = rest[4:].lstrip()
    if keyword in {"RUN", "CMD", "ENTRYPOINT", "HEALTHCHECK", "SHELL"} and rest.startswith("["):
        try:
            exec_form = json.loads(rest)
        except json.JSONDecodeError:
            exec_form = None  # Docker treats an invalid JSON array as the shell form
        else:
            if not (isinstance(exec_form, list) and all(isinstance(word, str) for word in exec_form)):
                exec_form = None
    return Instruction(keyword, flags, rest, exec_form, line)


_VARIABLE = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def substitute(text: str, variables: Mapping[str, str]) -> str:
    """Docker's variable substitution: ``$NAME``, ``${NAME}``, ``${NAME:-word}``, ``${NAME:+word}``, ``\\$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group(1) or match.group(4)
        value = variables.get(name, "")
        if match.group(2) == "-":
            return value if value else substitute(match.group(3), variables)
        if match.group(2) == "+":
            return substitute(match.group(3), variables) if value else ""
        return value

    return _VARIABLE.sub(replace, text)


def dockerignore_excludes(patterns_text: str, path: str) -> bool:
    """Whether ``.dockerignore`` (its text) excludes ``path`` (relative, ``/``-separated).

    Docker's rules: patterns match from the context root; ``*`` and ``?`` stop at ``/``; ``**``
    matches any number of directories; a pattern that matches a directory excludes what it holds;
    ``!`` re-includes; the last matching pattern wins.
    """
    patterns = []
    for raw in patterns_text.splitlines():
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        negate = raw.startswith("!")
        pattern = os.path.normpath(raw[1:] if negate else raw).lstrip("/")
        patterns.append((negate, pattern))
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]  # the path and its parents
    excluded = False
    for negate, pattern in patterns:
        regex = _dockerignore_regex(pattern)
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def replay(
    dockerfile: Dockerfile,
    target: str,
    *,
    context: Path,
    sandbox: Path,
    base_env: Mapping[str, str],
    build_args: Mapping[str, str] | None = None,
    skip_run: Callable[[str], bool] = lambda command: False,
    run_timeout_s: float = 600.0,
) -> dict[str, StageResult]:
    """Replay stage ``target`` and the stages it copies from; the results by stage name.

    Raises:
        SandboxEscape: a WORKDIR or COPY destination outside ``sandbox``.
        UnsupportedInstruction: an instruction or option this module does not implement.
        subprocess.CalledProcessError: a RUN step failed (its output is in the exception).
    """
    sandbox = sandbox.resolve()
    ignore_text = (context / ".dockerignore").read_text() if (context / ".dockerignore").exists() else ""
    global_args: dict[str, str] = {}
    for instruction in dockerfile.global_args:
        name, value = _arg(instruction, {})
        global_args[name] = (build_args or {}).get(name, value)
    results: dict[str, StageResult] = {}
    started: dict[str, Future[StageResult]] = {}
    lock = threading.Lock()

    def stage_done(name: str) -> StageResult:
        """Wait for stage ``name``, starting it if nothing has yet (COPY --from needs it)."""
        with lock:
            if name not in started:
                started[name] = workers.submit(run_stage, dockerfile.stage(name))
        return started[name].result()

    def run_stage(stage: Stage) -> StageResult:
        key = stage.name or str(dockerfile.stages.index(stage))
        result = StageResult(stage.name, substitute(stage.base, global_args), dict(base_env), {}, None)
        for instruction in stage.instructions:
            variables = {**result.args, **result.env}
            keyword = instruction.keyword
            if keyword == "ARG":
                name, value = _arg(instruction, variables)
                if name in (build_args or {}):
                    value = build_args[name]
                elif value is None:
                    value = global_args.get(name)
                if value is not None:
                    result.args[name] = value
            elif keyword == "ENV":
                for name, value in _env_pairs(instruction):
                    result.env[name] = substitute(value, variables)
            elif keyword == "WORKDIR":
                workdir = _resolve(substitute(instruction.args, variables), result.workdir)
                _check_inside(workdir, sandbox, instruction)
                workdir.mkdir(parents=True, exist_ok=True)
                result.workdir = workdir
            elif keyword == "COPY":
                _copy(instruction, variables, result, context, ignore_text, sandbox, stage_done)
            elif keyword == "RUN":
                if instruction.flags:
                    raise UnsupportedInstruction(f"line {instruction.line}: RUN options {instruction.flags}")
                command = instruction.args
                if skip_run(command):
                    result.skipped_runs.append(command)
                    continue
                if result.workdir is None:
                    raise UnsupportedInstruction(f"line {instruction.line}: RUN before any WORKDIR")
                argv = instruction.exec_form or ["/bin/sh", "-c", command]
                subprocess.run(argv, cwd=result.workdir, env={**result.args, **result.env}, check=True,
                               capture_output=True, text=True, timeout=run_timeout_s)
                result.ran.append(command)
            elif keyword == "USER":
                result.user = substitute(instruction.args, variables)
            elif keyword == "EXPOSE":
                result.expose += substitute(instruction.args, variables).split()
            elif keyword == "HEALTHCHECK":
                result.healthcheck = instruction
            elif keyword == "ENTRYPOINT":
                result.entrypoint = instruction
            elif keyword == "CMD":
                result.cmd = instruction
            elif keyword == "LABEL":
                pass
            else:
                raise UnsupportedInstruction(f"line {instruction.line}: {keyword}")
        results[key] = result
        return result

    # Like BuildKit, build the stages the target copies from while the target's own steps run.
    with ThreadPoolExecutor(max_workers=max(1, len(dockerfile.stages))) as workers:
        try:
            for name in _copied_from(dockerfile, target):
                with lock:
                    started.setdefault(name, workers.submit(run_stage, dockerfile.stage(name)))
            run_stage(dockerfile.stage(target))
        finally:
            for future in started.values():
                future.cancel()
    for future in started.values():
        if not future.cancelled():
            future.result()  # a failed stage the target did not wait for still fails the build
    return results


def _copied_from(dockerfile: Dockerfile, target: str) -> list[str]:
    """The stages ``target`` copies from, directly or through them, in order of first use."""
    order: list[str] = []

    def visit(name: str) -> None:
        for instruction in dockerfile.stage(name).instructions:
            source = instruction.flags.get("from") if instruction.keyword == "COPY" else None
            if source and source not in order:
                order.append(source)
                visit(source)

    visit(target)
    return order


def _arg(instruction: Instruction, variables: Mapping[str, str]) -> tuple[str, str | None]:
    name, sep, value = instruction.args.partition("=")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
        raise UnsupportedInstruction(f"line {instruction.line}: ARG {instruction.args}")
    return name.strip(), (substitute(_unquote(value), variables) if sep else None)


def _unquote(value: str) -> str:
    words = shlex.split(value)
    return words[0] if len(words) == 1 else value


def _env_pairs(instruction: Instruction) -> list[tuple[str, str]]:
    words = shlex.split(instruction.args, posix=True)
    if words and "=" not in words[0]:  # legacy "ENV NAME value with spaces"
        return [(words[0], instruction.args.split(None, 1)[1])]
    pairs = []
    for word in words:
        name, sep, value = word.partition("=")
        if not sep:
            raise UnsupportedInstruction(f"line {instruction.line}: ENV {instruction.args}")
        pairs.append((name, value))
    return pairs


def _resolve(path: str, workdir: Path | None) -> Path:
    if path.startswith("/"):
        return Path(os.path.normpath(path))
    if workdir is None:
        raise UnsupportedInstruction(f"relative path {path!r} before any WORKDIR")
    return Path(os.path.normpath(workdir / path))


def _check_inside(path: Path, sandbox: Path, instruction: Instruction) -> None:
    if path != sandbox and sandbox not in path.parents:
        raise SandboxEscape(f"line {instruction.line}: {instruction.keyword} writes {path}, outside {sandbox}")


def _copy(instruction, variables, result, context, ignore_text, sandbox, stage_done) -> None:
    flags = dict(instruction.flags)
    source_stage = flags.pop("from", None)
    mode = flags.pop("chmod", None)
    flags.pop("chown", None)
    if flags:
        raise UnsupportedInstruction(f"line {instruction.line}: COPY options {sorted(flags)}")
    if instruction.args.startswith("["):
        raise UnsupportedInstruction(f"line {instruction.line}: COPY [json form]")
    words = [substitute(word, variables) for word in instruction.args.split()]
    if len(words) < 2:
        raise UnsupportedInstruction(f"line {instruction.line}: COPY needs a source and a destination")
    *sources, destination = words
    dest = _resolve(destination, result.workdir)
    _check_inside(dest, sandbox, instruction)
    into_directory = destination.endswith("/") or len(sources) > 1
    for source in sources:
        if any(char in source for char in "*?["):
            raise UnsupportedInstruction(f"line {instruction.line}: wildcards in COPY sources")
        if source_stage is not None:
            stage_done(source_stage)
            origin = Path(os.path.normpath(source))
            if sandbox not in origin.parents:
                raise SandboxEscape(f"line {instruction.line}: COPY --from reads {origin}, outside {sandbox}")
        else:
            relative = os.path.normpath(source)
            if relative.startswith("..") or relative.startswith("/"):
                raise UnsupportedInstruction(f"line {instruction.line}: {source} is outside the context")
            if dockerignore_excludes(ignore_text, relative):
                raise FileNotFoundError(f"line {instruction.line}: {source} is excluded by .dockerignore")
            origin = context / relative
        if origin.is_dir():
            _copy_tree(origin, dest, context if source_stage is None else None, ignore_text, mode)
        else:
            target = dest / origin.name if into_directory or dest.is_dir() else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
            if mode:
                target.chmod(int(mode, 8))


def _copy_tree(origin: Path, dest: Path, context: Path | None, ignore_text: str, mode: str | None) -> None:
    for path in sorted(origin.rglob("*")):
        if context is not None and dockerignore_excludes(ignore_text, path.relative_to(context).as_posix()):
            continue
        target = dest / path.relative_to(origin)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        if mode:
            target.chmod(int(mode, 8))

