"""docs/accuracy.md's runnable examples print what the code prints: the worked example of each explain
label (order, missing, duplicated, replaced, extra, precision, nonfinite, unexplained, ambiguous) and
the report's "where the error lives" section.

Each block is run in a fresh namespace by ``support.docrun`` and every line it prints is compared with
the documentation's; ``python -m support.docrun ../docs/accuracy.md`` (from tests/) writes them back
after a deliberate change. The labels' arithmetic is checked by hand in test_explain.py; here, that the
page shows real output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moegrad.accuracy import LABELS
from support import docrun

DOC = Path(__file__).resolve().parents[3] / "docs" / "accuracy.md"
BLOCKS = {block.name: block for block in docrun.blocks(DOC.read_text(encoding="utf-8"))}


def test_the_blocks_are_found():
    assert set(BLOCKS) == {"explain-labels", "row-errors"}


def test_every_label_has_its_worked_example():
    printed = "\n".join(line for step in BLOCKS["explain-labels"].steps for line in step.expected)
    for label in LABELS:
        assert f"rows differ ({label} 1)" in printed, label


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_a_block_prints_what_the_documentation_says(name):
    block = BLOCKS[name]
    for step, printed in zip(block.steps, docrun.run(block), strict=True):
        assert printed == step.expected, "\n".join(step.source)
