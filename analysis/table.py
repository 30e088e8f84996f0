"""The one table type every parser returns.

A `Table` is column-oriented: an ordered mapping of column name to a list of values, plus a
description of each column (units live in the name: `_us`, `_bytes`, `_GBps`), the file it came
from, and the warnings raised while reading it (a truncated file yields a partial table and a
warning naming the file and the line or byte, never an exception).

`Table.meta` holds the facts about the whole source that are no column (a trace's world size, a log's layout, an
export's versions) as a typed, immutable `typing.NamedTuple`: one class per table kind, defined beside the parser
or analyzer that builds it (e.g. analysis.parsers.kineto.KinetoMeta), its fields read by attribute
(`t.meta.world_size`); a field the source did not state is None. A table without such facts holds `NO_META`.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, NamedTuple


class NoMeta(NamedTuple):
    """The meta of a table that has none (a table built from rows alone, most analyzers' results): no fields."""


NO_META = NoMeta()


def _is_meta(value: Any) -> bool:
    """A NamedTuple instance: a tuple whose class names its fields."""
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


class Table:
    """Immutable after construction (frozen like a dataclass, without importing dataclasses: the
    report's start-up time counts against the analysis speed target)."""

    __slots__ = ("name", "columns", "doc", "source", "warnings", "meta", "__weakref__")

    def __init__(self, name: str, columns: Mapping[str, list[Any]], doc: Mapping[str, str], source: str = "",
                 warnings: tuple[str, ...] = (), meta: Any = None) -> None:
        for attr, value in (("name", name), ("columns", columns), ("doc", doc), ("source", source),
                            ("warnings", warnings), ("meta", NO_META if meta is None else meta)):
            object.__setattr__(self, attr, value)
        self.__post_init__()

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(f"Table is immutable: cannot set {attr!r}")

    def __delattr__(self, attr: str) -> None:
        raise AttributeError(f"Table is immutable: cannot delete {attr!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Table:
            return NotImplemented
        # NamedTuples of different kinds with equal values compare equal as tuples: the kinds must match too.
        return type(self.meta) is type(other.meta) and all(
            getattr(self, a) == getattr(other, a) for a in ("name", "columns", "doc", "source", "warnings", "meta"))

    __hash__ = None  # type: ignore[assignment]  # mutable contents, as the frozen dataclass with dict fields

    def __repr__(self) -> str:
        return (f"Table(name={self.name!r}, rows={len(self)}, columns={list(self.columns)}, "
                f"source={self.source!r}, warnings={len(self.warnings)})")

    def __post_init__(self) -> None:
        if not _is_meta(self.meta):
            raise TypeError(f"table {self.name}: meta must be a NamedTuple (or NO_META), not "
                            f"{type(self.meta).__name__}")
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
        meta: Any = None,
    ) -> "Table":
        cols: dict[str, list[Any]] = {c: [] for c in doc}
        for row in rows:
            for c in doc:
                cols[c].append(row.get(c))
        return cls(name, cols, dict(doc), source, tuple(warnings), NO_META if meta is None else meta)

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
