"""docs/semantics.md section 9's profile table against moegrad.PROFILES, row by row.

The table is written for people (sources, what was inferred); this test keeps each of its facts in
step with the one table in code: every profile has exactly one row, and each row's chip, release,
order of adds, invalid-slot rule, attribute code, empty behaviour and source say what the profile
says. It also checks that section 7.6's generated table lists the groups bench/order_differences.py
finds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moegrad import PROFILES

SEMANTICS = Path(__file__).resolve().parents[3] / "docs" / "semantics.md"
HEADER = "| profile | chip | release | order of adds |"
ORDER_WORDS = {"bins": "bins", "groups_of_four": "groups of four", "chain": "chain from +0.0"}


def table_rows() -> dict[str, list[str]]:
    text = SEMANTICS.read_text()
    start = text.index(HEADER)
    lines = text[start:].splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().replace("`", "") for cell in line.strip("|").split("|")]
        assert cells[0] not in rows, f"{cells[0]} has two rows"
        rows[cells[0]] = cells
    return rows


def test_every_profile_has_one_row():
    assert list(table_rows()) == list(PROFILES)


@pytest.mark.parametrize("name", list(PROFILES))
def test_the_row_says_what_the_profile_says(name):
    profile = PROFILES[name]
    _, chip, release, order, invalid, code, empty, source = table_rows()[name]
    assert chip == (profile.product if profile.chip else "none")
    assert release == (profile.release or "-")
    assert order.startswith(ORDER_WORDS[profile.schedule])
    assert ("any negative index" in invalid) == profile.skips_any_negative
    assert ("dropless >= N*K" in invalid) == profile.skips_dropless_overflow
    assert "drop/pad" in invalid and ("-1" in invalid or profile.skips_any_negative)
    assert code.split(";")[0] == str(int(profile.attribute_status))
    assert ("out.dtype checked (161002)" in code) == profile.checks_out_dtype
    assert ("no launch" in empty) == profile.empty_out_skips_checks
    cited = profile.source.split(" (")[0]  # repository, path and commit, without the note
    assert cited in source, f"{name}: the doc cites {source!r}, the table {profile.source!r}"


def test_the_generated_differences_name_the_groups():
    text = SEMANTICS.read_text()
    block = text[text.index("<!-- order-differences:begin -->"):text.index("<!-- order-differences:end -->")]
    groups = re.search(r"Profiles with bit-identical results on every input here[^:]*: (.*)\.", block)
    assert groups, "run python -m bench.order_differences --write"
    named = [set(group.strip("{}").split(", ")) for group in groups.group(1).split("; ")]
    by_order: dict[str, set[str]] = {}
    for name, profile in PROFILES.items():
        by_order.setdefault(profile.schedule, set()).add(name)
    assert sorted(map(sorted, named)) == sorted(map(sorted, by_order.values()))
