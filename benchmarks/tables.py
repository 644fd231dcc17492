"""Cells and tables of docs/benchmarks.md: number formats, verdicts, one ``Table`` type.

The report modules build ``Table`` rows (already formatted cells); the template renders
them with the ``table`` filter (tabulate, pipe format: first column left, the rest right
unless ``align`` says otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tabulate import tabulate

VERDICT = {True: "**met**", False: "**not met**", None: "-"}


def num(x: float | None, digits: int = 2, grouped: bool = False) -> str:
    """``x`` with ``digits`` decimals (thousands separated if ``grouped``); n/a for None/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}" if grouped else f"{x:.{digits}f}"


def ms(x: float | None) -> str:
    """Milliseconds with sensible digits (0.042, 4.20, 42.0, 4,200)."""
    if x is None or math.isnan(x):
        return "n/a"
    return num(x, 3 if x < 1 else 2 if x < 10 else 1 if x < 100 else 0, grouped=True)


def times(a: float, b: float | None, digits: int = 1) -> str:
    """``a / b`` as "1.5x"; n/a when ``b`` is 0, None or NaN."""
    if not b or math.isnan(b) or math.isnan(a):
        return "n/a"
    return f"{a / b:.{digits}f}x"


def verdict(met: bool | None) -> str:
    return VERDICT[met]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    #: "right" / "left": every column after the first (which is left-aligned); or a list,
    #: one alignment per column.
    align: str | list[str] = "right"

    def markdown(self) -> str:
        colalign = self.align
        if isinstance(colalign, str):
            colalign = ["left"] + [colalign] * (len(self.header) - 1)
        return str(
            tabulate(
                self.rows,
                headers=self.header,
                tablefmt="pipe",
                colalign=colalign,
                disable_numparse=True,
            )
        )
