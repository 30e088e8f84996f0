"""The one table type every parser returns.

A `Table` is column-oriented: an ordered mapping of column name to a list of values, plus a
description of each column (units live in the name: `_us`, `_bytes`, `_GBps`), the file it came
from, and the warnings raised while reading it (a truncated file yields a partial table and a
warning naming the file and the line or byte, never an exception).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping


@dataclass(frozen=True)
class Table:
    name: str
    columns: Mapping[str, list[Any]]
    doc: Mapping[str, str]
    source: str = ""
    warnings: tuple[str, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {len(v) for v in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"table {self.name}: columns differ in length {sorted(lengths)}")
        missing = [c for c in self.columns if c not in self.doc]
        if missing:
            raise ValueError(f"table {self.name}: undocumented columns {missing}")

    @classmethod
    def from_rows(
        cls,
        name: str,
        doc: Mapping[str, str],
        rows: Iterable[Mapping[str, Any]],
        *,
        source: str = "",
        warnings: Iterable[str] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> "Table":
        cols: dict[str, list[Any]] = {c: [] for c in doc}
        for row in rows:
            for c in doc:
                cols[c].append(row.get(c))
        return cls(name, cols, dict(doc), source, tuple(warnings), dict(meta or {}))

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def rows(self) -> Iterator[dict[str, Any]]:
        names = list(self.columns)
        for values in zip(*(self.columns[c] for c in names)):
            yield dict(zip(names, values))

    def column(self, name: str) -> list[Any]:
        return self.columns[name]

    def where(self, **equals: Any) -> "Table":
        keep = [r for r in self.rows() if all(r.get(k) == v for k, v in equals.items())]
        return Table.from_rows(self.name, self.doc, keep, source=self.source,
                               warnings=self.warnings, meta=self.meta)

    def to_pandas(self):  # pragma: no cover - convenience for notebooks
        import pandas as pd

        return pd.DataFrame(dict(self.columns))
