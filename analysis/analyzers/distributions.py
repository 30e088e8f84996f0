"""Per-rank numbers as distributions over the ranks, so that a run of many ranks gives a table a person can read: for
each quantity its minimum, median, 90th percentile and maximum over the ranks and the ranks furthest on its bad side,
by name. The report shows these as each run's row (runs of several ranks); every rank's row of a run of up to
PER_RANK_ROWS_MAX ranks goes to its appendix."""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from analysis.table import Table

PER_RANK_ROWS_MAX = 64
WORST_SHOWN = 3

DISTRIBUTION_COLUMNS = {
    "group": "what the rows are split by (a collective, a kernel type); '' when the table is not split",
    "quantity": "the per-rank column summarised (its unit in its name)",
    "ranks": "ranks with a value",
    "min": "smallest value over the ranks",
    "median": "median over the ranks",
    "p90": "90th percentile over the ranks (statistics.quantiles, inclusive: linear between the ranks' values)",
    "max": "largest value over the ranks",
    "worst": f"the {WORST_SHOWN} ranks furthest on the bad side (see bad), as (rank, value), worst first; ties in "
             f"rank order",
    "bad": "'high' or 'low': which side of the quantity is bad",
    "source": "the table summarised",
}


def rank_distributions(table: Table, quantities: Sequence[tuple[str, str]], *, by: str | None = None) -> Table:
    """The distribution over `table`'s rows (one per rank, or one per rank and `by` value) of each (column, bad side)
    in `quantities`; one row per `by` value (in the order first seen) and quantity. Rows without a value are left out;
    a quantity no rank has is left out."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in table.rows():
        groups.setdefault(r[by] if by else "", []).append(r)
    rows = []
    for group, members in groups.items():
        for column, bad in quantities:
            values = [(r["rank"], r[column]) for r in members if r[column] is not None]
            if not values:
                continue
            ordered = sorted(v for _, v in values)
            p90 = statistics.quantiles(ordered, n=10, method="inclusive")[8] if len(ordered) > 1 else ordered[0]
            worst = sorted(values, key=lambda rv: -rv[1] if bad == "high" else rv[1])[:WORST_SHOWN]
            rows.append({"group": group, "quantity": column, "ranks": len(values), "min": ordered[0],
                         "median": statistics.median(ordered), "p90": p90, "max": ordered[-1],
                         "worst": tuple(worst), "bad": bad, "source": table.source})
    return Table.from_rows(f"{table.name}_distribution", DISTRIBUTION_COLUMNS, rows, source=table.source)
