"""Bus bandwidth against message size: one panel per collective, one line per run.

    python -m analysis.comm_plot RUN_DIR_OR_FILE [...] -o OUT.png [--nominal GBPS] [--placement best|out-of-place|in-place]

A run directory contributes its built-in sweep (`commbench/<op>.json`, unrounded) and, when present,
NVIDIA nccl-tests' output (`commbench/nccl-tests/<op>.txt`) as a second line; a file may be any
nccl-tests / rccl-tests text output or a commbench JSON. The dashed line is the link's nominal bus
bandwidth from the run's hardware profile (intra- or inter-node, as the measured group spans), the
number busbw is meant to be compared with.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from analysis.parsers.nccl_tests import COLUMNS, parse_nccl_tests
from analysis.table import Table
from launch.comm.commbench_spec import read_result
from launch.config.commbench import groups_of

ORDER = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "sendrecv", "reduce", "gather",
         "scatter", "alltoallv", "hypercube")
PLACEMENTS = ("best", "out-of-place", "in-place")


def busbw_series(table: Table, op: str, placement: str = "best") -> tuple[list[int], list[float]]:
    """(sizes, busbw GB/s) of `op` in `table`; "best" keeps the higher of the two placements per size."""
    best: dict[int, float] = {}
    for r in table.rows():
        if r["op"] != op or r["busbw_GBps"] is None or r["size_bytes"] <= 0:
            continue
        if placement != "best" and r["placement"] != placement:
            continue
        best[r["size_bytes"]] = max(best.get(r["size_bytes"], 0.0), r["busbw_GBps"])
    sizes = sorted(best)
    return sizes, [best[s] for s in sizes]


def busbw_plot(tables: Mapping[str, Table], *, nominal_GBps: float | None = None, out_png: str | Path,
               placement: str = "best", title: str | None = None) -> Path:
    """Draw bus bandwidth vs message size (log x) for every collective in `tables` ({label: nccl_tests table})."""
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    from analysis.report_plots import plain_text

    if placement not in PLACEMENTS:
        raise ValueError(f"busbw_plot: placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    present = {r["op"] for t in tables.values() for r in t.rows()}
    ops = [op for op in ORDER if op in present] + sorted(present - set(ORDER))
    if not ops:
        raise ValueError("busbw_plot: the tables hold no rows")
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    fig = Figure(figsize=(5.2 * cols, 3.9 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, object] = {}
    for ax, op in zip(axes.flat, ops):
        for i, (label, table) in enumerate(tables.items()):
            sizes, busbw = busbw_series(table, op, placement)
            if not sizes:
                continue
            n = _nranks(table, op)
            style = "--" if "nccl-tests" in label else "-"
            (line,) = ax.plot(sizes, busbw, style, marker="o", markersize=3, linewidth=1.6,
                              color=colors[i % len(colors)])
            handles.setdefault(f"{label} (n={n})" if n else label, line)
        if nominal_GBps:
            ax.axhline(nominal_GBps, color="0.35", linestyle=(0, (4, 3)), linewidth=1.2)
            ax.annotate(f"nominal {nominal_GBps:g} GB/s", (0.02, nominal_GBps), xycoords=("axes fraction", "data"),
                        textcoords="offset points", xytext=(0, 3), fontsize=8, color="0.3")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=8))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _bytes(x)))
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], (nominal_GBps or 0) * 1.12))
        ax.set_title(plain_text(op), fontsize=11)
        ax.set_xlabel("message size")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    which = {"best": "best of out-of-place and in-place", "out-of-place": "out-of-place", "in-place": "in-place"}
    fig.suptitle(plain_text(title) if title else
                 f"bus bandwidth vs message size ({which[placement]}; dashed reference: nominal link busbw)",
                 fontsize=12)
    fig.legend(list(handles.values()), [plain_text(h) for h in handles], loc="lower center",
               ncol=min(3, len(handles)), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.0))
    legend_rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.02, 1, 0.95))
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    return out


def _nranks(table: Table, op: str) -> int | None:
    for section in table.meta.get("sections", []):
        if section.get("op") == op and section.get("nranks"):
            return section["nranks"]
    return table.meta.get("nranks")


def _bytes(x: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if x >= size:
            return f"{x / size:g}{unit}"
    return f"{x:g}"


# --------------------------------------------------------------------------- loading


def commbench_table(result: Mapping) -> Table:
    """A commbench JSON result (launch.comm.commbench_spec.read_result) as an `nccl_tests` table."""
    op = result["nccl_tests_op"]
    rows = [{**r, "section": 0, "op": op} for r in result["rows"]]
    section = {"op": op, "nranks": result["group_size"], "avg_busbw_GBps": result["avg_busbw_GBps"]}
    return Table.from_rows("nccl_tests", COLUMNS, rows, source=f"commbench {result['op']}",
                           meta={**section, "ops": [op], "sections": [section]})


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
        sections.extend(t.meta.get("sections", []))
        rows.extend({**r, "section": (r["section"] or 0) + offset} for r in t.rows())
    return Table.from_rows("nccl_tests", COLUMNS, rows, source=", ".join(t.source for t in parts),
                           meta={"ops": sorted({r["op"] for r in rows}), "sections": sections})


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


def _first_nominal(inputs: Sequence[str]) -> float | None:
    """nominal_from_run of the first run directory that has one; a damaged resolved.json is warned about."""
    from launch.errors import ConfigError

    for p in inputs:
        if not Path(p).is_dir():
            continue
        try:
            nominal = nominal_from_run(p)
        except (ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
            print(f"warning: {p}: its resolved.json cannot be read ({exc}); no nominal busbw from it", file=sys.stderr)
            continue
        if nominal:
            return nominal
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.comm_plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="run directories, commbench/<op>.json files or nccl-tests text outputs")
    ap.add_argument("-o", "--out", required=True, help="PNG to write")
    ap.add_argument("--nominal", type=float, help="reference busbw in GB/s (default: the first run's hardware profile)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="best")
    args = ap.parse_args(argv)
    missing = [p for p in args.inputs if not Path(p).exists()]
    if missing:
        print(f"error: {missing[0]} does not exist; pass run directories or result files", file=sys.stderr)
        return 2
    tables, warnings = load(args.inputs)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not any(len(t) for t in tables.values()):
        print("error: no results to plot in " + ", ".join(args.inputs), file=sys.stderr)
        return 2
    nominal = args.nominal if args.nominal is not None else _first_nominal(args.inputs)
    out = busbw_plot(tables, nominal_GBps=nominal, out_png=args.out, placement=args.placement)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
