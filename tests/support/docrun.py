"""Runnable examples in the documentation: blocks whose printed output must be what the code prints.

A block sits between ``<!-- doc-run:begin NAME -->`` and ``<!-- doc-run:end -->`` in a markdown file,
inside a fenced code block, written as an interactive session: a statement starts with ``>>> ``
and continues with ``... ``; the lines after it, up to the next statement, are what it prints (an
expression statement prints its repr, as at the prompt; blank lines count). Unlike doctest, a blank
line needs no marker, so the block reads as a session would.

``python -m support.docrun FILE`` (from tests/) runs every block of FILE and writes what each
statement printed back into it: how a block's output is made; the tests then check it stays so.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "Step", "blocks", "render", "run"]

_BLOCK = re.compile(r"<!-- doc-run:begin (?P<name>[\w-]+) -->\n```python\n(?P<body>.*?)```\n<!-- doc-run:end -->", re.S)


@dataclass
class Step:
    """One statement of a block and the lines it is said to print."""

    source: list[str]
    expected: list[str]


@dataclass
class Block:
    name: str
    steps: list[Step]
    span: tuple[int, int]  # the body's place in the file


def blocks(text: str) -> list[Block]:
    """Every runnable block of a markdown text."""
    found = []
    for match in _BLOCK.finditer(text):
        steps: list[Step] = []
        for line in match["body"].rstrip("\n").split("\n"):
            if line.startswith(">>> "):
                steps.append(Step([line[4:]], []))
            elif line.startswith("... ") or line == "...":
                steps[-1].source.append(line[4:])
            else:
                steps[-1].expected.append(line.rstrip())
        found.append(Block(match["name"], steps, match.span("body")))
    return found


def run(block: Block) -> list[list[str]]:
    """Run a block's statements in one fresh namespace; what each printed, line by line."""
    namespace: dict = {"__name__": "__doc__"}
    printed = []
    for step in block.steps:
        buffer = io.StringIO()
        code = compile("\n".join(step.source) + "\n", f"<{block.name}>", "single")
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)  # noqa: S102  (the documentation's own examples)
        text = buffer.getvalue()
        printed.append([line.rstrip() for line in text.rstrip("\n").split("\n")] if text else [])
    return printed


def render(block: Block, printed: list[list[str]]) -> str:
    """The block's body with ``printed`` as each statement's output."""
    lines = []
    for step, output in zip(block.steps, printed, strict=True):
        lines += [">>> " + step.source[0], *("... " + line for line in step.source[1:]), *output]
    return "\n".join(lines) + "\n"


def main(path: str) -> None:
    text = Path(path).read_text(encoding="utf-8")
    for block in reversed(blocks(text)):  # from the end, so that earlier spans stay valid
        start, stop = block.span
        text = text[:start] + render(block, run(block)) + text[stop:]
    Path(path).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
