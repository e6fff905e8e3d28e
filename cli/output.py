"""How the CLI prints tables and times: one way for every table command (`status`, `queues`, `webhooks list`,
`report`, `audit`, `tokens list`, the demo's report).

- An identifier (job id, queue, team, webhook id, timestamp, number, cost) is never cut nor wrapped: a reader copies
  it into the next command. Only free text (reasons, messages, URLs) wraps.
- At a terminal (`-o table`, the default) the table fits the terminal's width: columns marked droppable are left out,
  least important first, until the identifiers fit; free text wraps into what is left.
- `-o wide` shows every column; piped (stdout not a terminal) the table is printed at its full width, so `grep` and
  `awk` see whole lines, never a width guessed for a terminal that is not there.
- `-o json|yaml|csv`: the command's records, for programs.

rich and yaml are imported where used: the commands that print no table do not pay for them.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text


class OutputFormat(StrEnum):
    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"
    CSV = "csv"

    @property
    def machine(self) -> bool:
        return self in (OutputFormat.JSON, OutputFormat.YAML, OutputFormat.CSV)


FORMAT_HELP = "table (fits the terminal), wide (every column), json, yaml or csv"


def output_option(*aliases: str) -> Any:
    """The `-o/--output` option of a table command; `aliases` keep a command's older spelling (`--format`)."""
    return typer.Option(OutputFormat.TABLE, "--output", "-o", *aliases, help=FORMAT_HELP, case_sensitive=False)


def stdout_console() -> Console:
    """The console the commands print on: piped, a line is written whole (rich would wrap it at a width guessed for a
    terminal that is not there); at a terminal, text wraps at its width."""
    from rich.console import Console

    return Console(soft_wrap=not sys.stdout.isatty())


# ------------------------------------------------------------------------------------------------ machine output


def _plain(value: Any) -> Any:
    """JSON's types only (datetimes and the like as their string), so YAML and JSON say the same."""
    return json.loads(json.dumps(value, default=str))


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


def machine_text(data: Any, fmt: OutputFormat, *, fields: Sequence[str] | None = None) -> str:
    """`data` as JSON, YAML or CSV. CSV needs a list of flat records: its columns are `fields` (default: every key,
    in first-seen order); a nested value is written as its JSON."""
    if fmt is OutputFormat.JSON:
        return json.dumps(data, indent=2, default=str) + "\n"
    if fmt is OutputFormat.YAML:
        import yaml

        return str(yaml.safe_dump(_plain(data), sort_keys=False, allow_unicode=True))
    if fmt is OutputFormat.CSV:
        records = list(data)
        columns = list(fields) if fields is not None else list(dict.fromkeys(k for r in records for k in r))
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        for record in records:
            writer.writerow([_csv_cell(record.get(c)) for c in columns])
        return buf.getvalue()
    raise ValueError(f"{fmt.value} is not a machine format")


def print_machine(data: Any, fmt: OutputFormat, *, fields: Sequence[str] | None = None) -> None:
    sys.stdout.write(machine_text(data, fmt, fields=fields))
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------ tables


@dataclass(frozen=True)
class Column:
    """One column of a table. `kind`: "id", an identifier, time, count or cost, never cut nor wrapped; "words",
    identifiers separated by spaces (`H100-80GB:32 A100-40GB:8`, node lists), which wrap between them, never inside
    one; "text", free text (reasons, messages, URLs), which wraps. `drop`: at a narrow terminal the columns with
    the highest `drop` are left out first (0: always shown). `wide`: only with `-o wide`."""

    header: str
    kind: Literal["id", "words", "text"] = "id"
    drop: int = 0
    wide: bool = False
    justify: Literal["left", "right"] = "left"


TEXT_MIN = 12  # free text narrower than this is unreadable: drop a column rather than squeeze it further
GUTTER = 2  # between two columns (no box: every character goes to the cells)


def _plain_text(cell: str | Text) -> str:
    return cell if isinstance(cell, str) else cell.plain


def _width(cell: str | Text) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in _plain_text(cell).split("\n")), default=0)


def _longest_word(cell: str | Text) -> int:
    from rich.cells import cell_len

    return max((cell_len(word) for word in _plain_text(cell).split()), default=0)


@dataclass(frozen=True)
class _Measure:
    natural: int  # on one line
    least: int  # the narrowest it may be made

    @staticmethod
    def of(column: Column, cells: Sequence[str | Text]) -> _Measure:
        natural = max([_width(column.header), *(_width(c) for c in cells)])
        if column.kind == "id":  # whole; only its header may wrap, between words ("allocated / GPU-h")
            return _Measure(natural, max([_longest_word(column.header), *(_width(c) for c in cells)]))
        words = max([_longest_word(column.header), *(_longest_word(c) for c in cells)])
        return _Measure(natural, words if column.kind == "words" else min(natural, max(TEXT_MIN, 1)))


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], width: int | None) -> list[int]:
    """The indexes of the columns shown in `width` characters (None: all of them). Droppable columns go, highest
    `drop` first (the rightmost among equals), until every column at its narrowest fits (identifiers whole)."""
    shown = list(range(len(columns)))
    if width is None:
        return shown
    measure = {i: _Measure.of(columns[i], [r[i] for r in rows]) for i in shown}

    def need(indexes: list[int]) -> int:
        return sum(measure[i].least for i in indexes) + GUTTER * (len(indexes) - 1)

    while need(shown) > width:
        droppable = [i for i in shown if columns[i].drop > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    return shown


def layout(measures: Sequence[_Measure], width: int | None) -> list[int] | None:
    """Each column's width: its natural width when everything fits on one line (or `width` is None); else the
    wrapping columns share what the identifiers leave, the narrow ones at their natural width first. None when
    even the narrowest widths do not fit."""
    gutters = GUTTER * (len(measures) - 1)
    natural = [m.natural for m in measures]
    if width is None or sum(natural) + gutters <= width:
        return natural
    if sum(m.least for m in measures) + gutters > width:
        return None
    widths = [m.least for m in measures]
    spare = width - gutters - sum(widths)
    growing = sorted((i for i, m in enumerate(measures) if m.natural > m.least), key=lambda i: measures[i].natural)
    for n, i in enumerate(growing):
        share = spare // (len(growing) - n)
        extra = min(share, measures[i].natural - widths[i])
        widths[i] += extra
        spare -= extra
    return widths


def render_table(columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], *, fmt: OutputFormat,
                 console: Console, title: str | None = None,
                 totals: Sequence[Sequence[str | Text]] = ()) -> None:
    """Print a table as the module's docstring says. Cells are plain text (never markup: an id or a reason may hold
    brackets) or rich Text for a styled cell. `totals`: rows printed after a rule, in bold."""
    from rich.table import Table
    from rich.text import Text

    wanted = [i for i, c in enumerate(columns) if fmt is OutputFormat.WIDE or not c.wide]
    cols = [columns[i] for i in wanted]
    body = [[r[i] for i in wanted] for r in rows]
    tail = [[r[i] for i in wanted] for r in totals]
    everything = [*body, *tail]
    fit_to = console.width if console.is_terminal and fmt is OutputFormat.TABLE else None
    shown = fit_columns(cols, everything, fit_to)
    measures = [_Measure.of(cols[i], [r[i] for r in everything]) for i in shown]
    widths = layout(measures, fit_to)
    table = Table(title=Text(title) if title else None, box=None, padding=(0, GUTTER // 2), pad_edge=False,
                  show_edge=False, header_style="bold", title_justify="left", expand=False)
    for n, i in enumerate(shown):
        col = cols[i]
        if widths is None:
            # a terminal narrower than the identifiers alone: everything folds onto more lines, nothing is cut
            table.add_column(col.header, justify=col.justify, overflow="fold")
        else:
            # an id column is at least as wide as its widest cell: only its header can wrap
            table.add_column(col.header, justify=col.justify, width=widths[n], overflow="fold")

    def cells(row: Sequence[str | Text]) -> list[Text]:
        return [c if isinstance(c, Text) else Text(c) for c in (row[i] for i in shown)]

    for row in body:
        table.add_row(*cells(row))
    if tail:
        table.add_section()
        for row in tail:
            table.add_row(*cells(row), style="bold")
    # piped or -o wide: the table at its own width, wider than any terminal if it must be (never cut to 80 columns)
    if fit_to is not None:
        console.print(table, soft_wrap=False)
        return
    # (print's own `width` is capped at the console's, so the console is widened while it prints)
    full = sum(m.natural for m in measures) + GUTTER * (len(shown) - 1)
    before = console.width
    console.width = max(full, before)
    try:
        console.print(table, crop=False, soft_wrap=False)
    finally:
        console.width = before


# ------------------------------------------------------------------------------------------------ times


def when(ts: float | datetime | str | None) -> str:
    """A time as the CLI shows it, like the servers' messages (shared.timefmt): UTC, zoned, to the second
    (`2026-12-05 14:03:07 UTC`). Accepts epoch seconds, a datetime (naive: UTC) or an ISO string; "-" for none."""
    if ts is None or ts == "":
        return "-"
    if isinstance(ts, str):
        at = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    elif isinstance(ts, datetime):
        at = ts
    else:
        at = datetime.fromtimestamp(float(ts), UTC)
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


def eta_cell(eta: float | None, now: float, overdue: bool | None = None) -> str:
    """An expected start as a table cell: never a time in the past. An ETA that has passed (stale until admission
    refreshes it) reads "any moment". `overdue`: the API's word on it (`eta_overdue`, judged on the platform's
    clock, which may run faster than this machine's: a demo's); None: judged here against `now`."""
    if eta is None:
        return "-"
    if overdue is None:
        overdue = eta <= now
    return "any moment (overdue)" if overdue else when(eta)


def eta_range_cell(low: float | None, high: float | None, now: float) -> str:
    """The likely range of the start (p10-p90): "-" without one; one time when both ends are the same (a
    range of nothing); its past part left out (the start cannot be earlier than now)."""
    if low is None or high is None:
        return "-"
    low, high = max(low, now), max(high, now)
    if high <= now:
        return "any moment (overdue)"
    first, last = when(low), when(high)
    if first == last:
        return first
    return f"{first} to {last[11:] if last[:10] == first[:10] else last}"


def duration(seconds: float | None) -> str:
    """A wait as people read it: 45s, 12m, 3h05m, 2d04h."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86_400}d{s % 86_400 // 3600:02d}h"
