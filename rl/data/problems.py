"""Bad rows of a prompt source: every problem found, each named by the file's own row number.

`DataError` is one ValueError for a whole source: a first line saying how many problems there are and how
rows are counted, then one line per problem (the first `MAX_LISTED`; a last line counts the rest), each naming
the file, the row, the column and what was expected.

Rows are the file's own records counted from 1, duplicates included: the checks number rows before
duplicate prompts are dropped, so "row 7" is the seventh record of the file whatever the rows before it
hold. In a JSON lines file the N-th record is its N-th non-blank line (the reader skips blank lines); where
blank lines make the two differ, the line number is given too. In a directory of files each line names the
file the row is in, counted within that file.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_LISTED = 20
ROWS_NOTE = "row N is the file's N-th record, counting from 1 and counting duplicates"


class DataError(ValueError):
    """Every problem of one prompt source, one line each (see the module docstring)."""

    def __init__(self, origin: str, lines: list[str], total: int, hint: str = ""):
        self.origin, self.lines, self.total = origin, list(lines), total
        header = f"{origin}: {total} problem{'' if total == 1 else 's'} ({ROWS_NOTE})"
        text = [header + (f"; {hint}" if hint else "") + ":", *self.lines]
        if total > len(self.lines):
            text.append(
                f"{origin}: and {total - len(self.lines)} more (the first {len(self.lines)} are listed)"
            )
        super().__init__("\n".join(text))


@dataclass
class Part:
    """Rows `start`.. of a table read from one file (or hub split): what row numbers are counted in."""

    name: str  # the file, or the hub id and split
    start: int  # its first row in the table
    json_lines: Path | None = None  # a JSON lines file, whose records are its non-blank lines


class RowNames:
    """Names a table row as the file and the row number there ("f.jsonl: row 7 (line 9)")."""

    def __init__(self, parts: list[Part]):
        self.parts = sorted(parts, key=lambda p: p.start)
        self._starts = [p.start for p in self.parts]
        self._lines: dict[Path, list[int]] = {}

    @classmethod
    def of_file(cls, path: Path) -> RowNames:
        return cls([Part(str(path), 0, path if path.suffix in (".jsonl", ".json") else None)])

    def name(self, row: int) -> str:
        part = self.parts[bisect.bisect_right(self._starts, row) - 1]
        n = row - part.start + 1
        text = f"{part.name}: row {n}"
        if part.json_lines is not None:
            line = self._line_of(part.json_lines, n)
            if line is not None and line != n:
                text += f" (line {line})"
        return text

    def _line_of(self, path: Path, n: int) -> int | None:
        """Line number of the n-th non-blank line (read once a file, and only to name a bad row)."""
        if path not in self._lines:
            try:
                with open(path, "rb") as f:
                    self._lines[path] = [i for i, line in enumerate(f, 1) if line.strip()]
            except OSError:
                self._lines[path] = []
        lines = self._lines[path]
        return lines[n - 1] if n <= len(lines) else None


class Problems:
    """Collects the problems of one source, cheaply even when most of a large file is bad: it counts all of
    them and keeps the `MAX_LISTED` with the lowest row numbers, which are the ones listed."""

    def __init__(self, origin: str, rows: RowNames):
        self.origin, self.rows = origin, rows
        self._columns: list[str] = []  # problems of a whole column (its type): listed first
        self._cells: list[tuple[int, int, str | None, str]] = []  # (row, seq, column, what)
        self._count = 0
        self._seq = 0

    def column(self, column: str, what: str) -> None:
        self._columns.append(f"{self.origin}: column {column!r}: {what}")

    def cell(self, row: int, column: str | None, what: str) -> None:
        self._count += 1
        self._seq += 1
        self._cells.append((row, self._seq, column, what))
        if len(self._cells) > 4 * MAX_LISTED:
            self._cells = sorted(self._cells)[:MAX_LISTED]

    def cells(self, rows: np.ndarray, column: str, what: str | Callable[[int], str]) -> None:
        """Rows (ascending table rows) where `column` has the same problem; `what(k)` describes the k-th of
        them and is called only for those that may be listed."""
        self._count += len(rows) - min(len(rows), MAX_LISTED)
        for k, row in enumerate(rows[:MAX_LISTED]):
            self.cell(int(row), column, what(k) if callable(what) else what)

    def __bool__(self) -> bool:
        return bool(self._count or self._columns)

    def raise_if_any(self, hint: str = "") -> None:
        if not self:
            return
        lines = self._columns[:MAX_LISTED]
        for row, _, column, what in sorted(self._cells)[: MAX_LISTED - len(lines)]:
            lines.append(f"{self.rows.name(row)}: " + (f"column {column!r}: " if column else "") + what)
        raise DataError(self.origin, lines, len(self._columns) + self._count, hint)


# JSON lines ------------------------------------------------------------------------------------------


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else "a list"


def json_lines_problems(path: Path, problems: Problems) -> None:
    """What keeps pyarrow from reading a JSON lines file, for every record at fault: a line that is not JSON
    or not an object, and a column (nested ones as `reward_model.ground_truth`, `prompt[].content`) whose
    type differs from the one its first non-null value set. pyarrow itself stops at the first and numbers
    rows within its read block, not the file."""
    kinds: dict[str, tuple[str, int]] = {}  # column -> (kind, first row holding it)

    def visit(column: str, value, row: int) -> None:
        if value is None:
            return
        kind = _kind(value)
        first = kinds.setdefault(column, (kind, row))
        if first[0] != kind:
            problems.cell(
                row,
                column,
                f"{kind}, but row {first[1] + 1} holds {first[0]}; a column holds one type "
                "(store answers as strings)",
            )
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{column}.{key}" if column else key, item, row)
        elif isinstance(value, list):
            for item in value:
                visit(f"{column}[]", item, row)

    row = -1
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            row += 1
            try:
                value = json.loads(line.rstrip(b"\r\n"))  # so that a position past the end is on this line
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                at = f" at character {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else ""
                reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                problems.cell(row, None, f"not valid JSON ({reason}{at}); expected one JSON object per line")
                continue
            if not isinstance(value, dict):
                problems.cell(row, None, f"{_kind(value)}; expected one JSON object per line")
                continue
            for key, item in value.items():
                visit(key, item, row)
