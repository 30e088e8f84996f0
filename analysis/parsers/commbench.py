"""Our commbench results and nccl-tests outputs as `nccl_tests` tables, loaded for the busbw-vs-size plot
(`python -m analysis busbw`) and for a run's own ceilings (analysis.parsers.runs).

A run directory contributes its built-in sweep (`commbench/<op>.json`, unrounded) and, when present,
NVIDIA nccl-tests' output (`commbench/nccl-tests/<op>.txt`) as a second line; a file may be any
nccl-tests / rccl-tests text output or a commbench JSON. `nominal_from_run` reads the link's nominal bus
bandwidth from the run's hardware profile (intra- or inter-node, as the measured group spans), the
number busbw is meant to be compared with.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

from analysis.parsers.nccl_tests import COLUMNS, NcclTestsMeta, NcclTestsSection, parse_nccl_tests
from analysis.table import Table
from launch.comm.commbench_spec import read_result
from launch.config.commbench import groups_of


def commbench_table(result: Mapping) -> Table:
    """A commbench JSON result (launch.comm.commbench_spec.read_result) as an `nccl_tests` table."""
    op = result["nccl_tests_op"]
    rows = [{**r, "section": 0, "op": op} for r in result["rows"]]
    section = NcclTestsSection(op=op, nranks=result["group_size"], avg_busbw_GBps=result["avg_busbw_GBps"])
    return Table.from_rows("nccl_tests", COLUMNS, rows, source=f"commbench {result['op']}",
                           meta=NcclTestsMeta(ops=[op], sections=[section], **section._asdict()))


def load(paths: Iterable[str | Path]) -> tuple[dict[str, Table], list[str]]:
    """{label: table} for run directories and result files, and the warnings met on the way."""
    groups: dict[str, list[Table]] = {}
    warnings: list[str] = []

    def add_result(label: str, f: Path) -> None:
        try:
            table = commbench_table(read_result(f))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # cut short, another program's JSON, or not an object at all: the other inputs still plot
            warnings.append(f"{f}: cannot be read as a commbench result ({str(exc).removeprefix(f'{f}: ')}); skipped")
            return
        groups.setdefault(label, []).append(table)

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            label = _run_label(path)
            for f in sorted((path / "commbench").glob("*.json")):
                add_result(label, f)
            for f in sorted((path / "commbench" / "nccl-tests").glob("*.txt")):
                groups.setdefault(f"{label} nccl-tests", []).append(parse_nccl_tests(f))
            if label not in groups:
                warnings.append(f"{path}: no readable commbench/*.json (was it a run.mode=commbench run?)")
        elif path.suffix == ".json":
            add_result(_file_label(path), path)
        else:
            groups.setdefault(_file_label(path), []).append(parse_nccl_tests(path))
    tables = {}
    for label, parts in groups.items():
        for t in parts:
            warnings.extend(t.warnings)
        tables[label] = parts[0] if len(parts) == 1 else _concat(parts)
    return tables, warnings


def _concat(parts: Sequence[Table]) -> Table:
    sections, rows = [], []
    for t in parts:
        offset = len(sections)
        sections.extend(t.meta.sections)
        rows.extend({**r, "section": (r["section"] or 0) + offset} for r in t.rows())
    return Table.from_rows("nccl_tests", COLUMNS, rows, source=", ".join(t.source for t in parts),
                           meta=NcclTestsMeta(ops=sorted({r["op"] for r in rows}), sections=sections))


def _run_label(run_dir: Path) -> str:
    return f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name


def _file_label(path: Path) -> str:
    """Files inside a run directory's commbench/ carry the run's label; others their own name."""
    parts = path.resolve().parts
    if "commbench" in parts:
        i = len(parts) - 1 - parts[::-1].index("commbench")
        label = _run_label(Path(*parts[:i]))
        return f"{label} nccl-tests" if "nccl-tests" in parts[i:] else label
    return path.stem


def nominal_from_run(run_dir: str | Path) -> float | None:
    """The hardware profile's busbw for the link the run's commbench group crossed, if it is a run directory."""
    from launch.config.resolve import Resolved
    from launch.run.rundir import RunDir

    run = RunDir.open(run_dir)
    if not RunDir.is_run_dir(run.root):
        return None
    resolved = Resolved.load(run.resolved)
    group = groups_of(resolved.recipe.commbench, resolved.grid)[0]
    hw = resolved.hardware
    return hw.inter_node_busbw_GBps if resolved.grid.spans_nodes(group) else hw.intra_node_busbw_GBps
