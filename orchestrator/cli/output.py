"""What commands print: rich tables and text for people, JSON for scripts. Apart from the group (`base`), so that
--version and --help do not load rich."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Pipes and CI get a wide fixed width so tables are not squeezed into 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Cells are text, never markup: "[prices.H100]" or a job named "[exp]" print as they are (rich took them for
    tags and printed nothing)."""
    t = Table(title=None if title is None else escape(title), title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(escape(c))
    for r in rows:
        t.add_row(*("" if v is None else escape(str(v)) for v in r))
    out.print(t)
