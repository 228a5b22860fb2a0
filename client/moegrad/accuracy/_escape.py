"""Text others chose (a case's name is its file's; a message may quote a server) made inert where it is written.

- :func:`csv_cell`: a CSV cell that no spreadsheet reads as a formula. OWASP's "CSV Injection"
  page: a cell starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is a formula to
  Excel, LibreOffice and Google Sheets; such text gets a leading single quote, which they read as
  "this is text". A number keeps its form (``-0.5``, ``-inf``), so numeric columns stay numeric.
- :func:`console_text`: control and format characters (Unicode categories Cc, Cf, Zl, Zp: a newline
  that forges a line, ESC that starts a terminal escape sequence, a bidirectional override that
  reorders what is shown), and the lone surrogates (Cs) a file name that is not UTF-8 decodes to,
  written as Python writes them in a string literal (``\\n``, ``\\x1b``, ``\\u202e``): visible,
  nothing the terminal acts on, and nothing an encoder refuses.
- :func:`markdown_text`: :func:`console_text`, then the ASCII punctuation that gives markdown or its
  HTML structure escaped with a backslash (CommonMark, "Backslash escapes": any ASCII punctuation
  may be), so text never ends a table cell (``|``), opens a tag, an entity, a link or a code span.
  Emphasis characters (``*``, ``_``) are left as they are: they change no structure, and a name
  such as ``case_0042`` reads as written.

JSON lines need nothing of this: ``json.dumps`` escapes every control character, and the results
file is split on ``\\n`` alone (:mod:`moegrad.accuracy._ledger`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

__all__ = ["FORMULA_TRIGGERS", "console_text", "csv_cell", "csv_row", "markdown_text"]

#: The first characters that make a spreadsheet read a CSV cell as a formula (OWASP, "CSV Injection").
FORMULA_TRIGGERS = frozenset("=+-@\t\r")
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_MARKDOWN = frozenset("\\`|<>[]&")
_MARKDOWN_ESCAPES = str.maketrans({char: "\\" + char for char in _MARKDOWN})


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text == text.strip()


def csv_cell(text: str) -> str:
    """``text`` as a CSV cell: a leading ``'`` when it starts with a formula trigger and is not a number."""
    if text[:1] in FORMULA_TRIGGERS and not _number(text):
        return "'" + text
    return text


def csv_row(row: Mapping[str, str]) -> dict[str, str]:
    """Every cell of ``row`` as :func:`csv_cell` writes it."""
    return {column: csv_cell(value) for column, value in row.items()}


def _visible(char: str) -> str:
    if unicodedata.category(char) not in _HIDDEN:
        return char
    return repr(char)[1:-1] if char.isascii() else f"\\u{ord(char):04x}"


def console_text(text: str) -> str:
    """``text`` with every control or format character written as its escape (``\\n``, ``\\x1b``, ``\\u202e``)."""
    if text.isprintable():  # the common case: nothing to escape (isprintable is False for Cc, Cf, Cs, Zl, Zp)
        return text
    return "".join(map(_visible, text))


def markdown_text(text: str) -> str:
    """``text`` as markdown shows it, on one line and inert: :func:`console_text`, then ``\\``,
    `````, ``|``, ``<``, ``>``, ``[``, ``]`` and ``&`` backslash-escaped."""
    return console_text(text).translate(_MARKDOWN_ESCAPES)
