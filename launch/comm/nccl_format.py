"""nccl-tests' text layout (src/util.cu) and bus factors, without torch: the one writer of that format.

The built-in collective sweep writes its results with it (launch/comm/commbench_spec.py) so that every tool
that reads nccl-tests output reads ours; analysis/parsers/nccl_tests.py reads it back and
re-exports `format_nccl_tests` and `bus_factor` from here (analysis may import launch, not the
other way round). Collective names are nccl-tests' own (`alltoall`, `sendrecv`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

# Bus factor per collective, as a function of the rank count (nccl-tests src/*.cu GetBw).
BUS_FACTORS: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("2(n-1)/n", lambda n: 2 * (n - 1) / n),
    "all_gather": ("(n-1)/n", lambda n: (n - 1) / n),
    "reduce_scatter": ("(n-1)/n", lambda n: (n - 1) / n),
    "alltoall": ("(n-1)/n", lambda n: (n - 1) / n),
    "alltoallv": ("(n-1)/n", lambda n: (n - 1) / n),
    "gather": ("(n-1)/n", lambda n: (n - 1) / n),
    "scatter": ("(n-1)/n", lambda n: (n - 1) / n),
    "broadcast": ("1", lambda n: 1.0),
    "reduce": ("1", lambda n: 1.0),
    "sendrecv": ("1", lambda n: 1.0),
    "hypercube": ("1", lambda n: 1.0),
}
OPS = tuple(BUS_FACTORS)
# Our collective names (planner, commbench, the analysis' `collective` column) -> nccl-tests' names: the one map.
NCCL_TESTS_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                 "all_to_all": "alltoall", "send_recv": "sendrecv", "broadcast": "broadcast", "reduce": "reduce",
                 "gather": "gather", "scatter": "scatter"}
TIME_WIDTH, BW_WIDTH = 7, 6  # printed widths of the time and bandwidth columns


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw ratio for `op` on `nranks` ranks (doc/PERFORMANCE.md)."""
    if op not in BUS_FACTORS:
        raise ValueError(f"bus_factor: unknown collective {op!r}; known: {', '.join(OPS)}")
    if nranks < 1:
        raise ValueError(f"bus_factor: nranks must be >= 1 (got {nranks})")
    return BUS_FACTORS[op][1](nranks)


def float_field(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: two decimals, fewer if that overflows the column, else exponent."""
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        text = fmt % (width, value)
        if len(text) <= width:
            return text
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def _version_code(version: str | tuple[int, ...]) -> int:
    parts = version.split(".") if isinstance(version, str) else list(version)  # torch gives (2, 21, 5)
    major, minor, patch = (int(x) for x in (parts + [0, 0])[:3])
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def format_nccl_tests(op: str, rows: Iterable[Mapping[str, Any]], header: Mapping[str, Any] | None = None) -> str:
    """Write results in nccl-tests' own layout (src/util.cu), which `parse_nccl_tests` reads back.

    `rows` are `nccl_tests` table rows (size_bytes, count, dtype, redop, root, placement, time_us,
    algbw_GBps, busbw_GBps, wrong); rows with the same size/count/dtype/redop/root are printed on
    one line, out-of-place then in-place. If every row is in-place, the rccl-tests in-place-only
    layout is used. `header` may carry nthreads, ngpus, min_bytes, max_bytes, step_factor or
    step_bytes, warmup_iters, iters, agg_iters, validation, graph, devices (list of {rank, group,
    pid, host, device, busid, name}: give them, or the rank count is lost), nccl_version and
    nccl_tests_version; missing iteration settings print nccl-tests' defaults.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"format_nccl_tests: unknown collective {op!r}; known: {', '.join(OPS)}")
    # None means "not known" in parsed meta; print nccl-tests' default (or what the rows imply) instead.
    header = {k: v for k, v in (header or {}).items() if v is not None}
    lines_by_key = _lines_by_key(rows)
    in_place_only = bool(lines_by_key) and all(set(p) == {"in-place"} for p in lines_by_key.values())
    order = ["in-place"] if in_place_only else ["out-of-place", "in-place"]
    for key, placements in lines_by_key.items():
        if set(placements) != set(order):
            raise ValueError(f"format_nccl_tests: size {key[0]} has {sorted(placements)}, need {order}")

    program = f"{op}_perf"
    out = _preamble(program, header, [k[0] for k in lines_by_key]) + _column_header(in_place_only)
    busbws: list[float] = []
    errors = 0
    for (size, count, dtype, redop, root), placements in lines_by_key.items():
        text = "%12li  %12li  %8s  %6s  %6s" % (size, count if count is not None else 0, dtype or "float",
                                                 redop or "none", "%6i" % (root if root is not None else -1))
        for placement in order:
            r = placements[placement]
            wrong = r.get("wrong")
            body = "  %7s  %6s  %6s" % (float_field(r["time_us"], TIME_WIDTH), float_field(r["algbw_GBps"], BW_WIDTH),
                                        float_field(r["busbw_GBps"], BW_WIDTH))
            text += body + ("  %6g" % wrong if wrong is not None else "    N/A")
            busbws.append(r["busbw_GBps"])
            errors += wrong or 0
        out.append(text)
    avg = header.get("avg_busbw_GBps", math.fsum(busbws) / len(busbws) if busbws else 0.0)
    out.append("# %-20s : %d %s" % ("Out of bounds values", errors, "FAILED" if errors else "OK"))
    out.append("# %-20s : %g " % ("Avg bus bandwidth", avg))
    out += ["#", f"# Collective test concluded: {program}", ""]
    return "\n".join(out)


def _lines_by_key(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Mapping[str, Any]]]:
    """The rows of each printed line, {(size, count, dtype, redop, root): {placement: row}}, in first-seen order."""
    lines_by_key: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        key = (row["size_bytes"], row.get("count"), row.get("dtype"), row.get("redop"), row.get("root"))
        placements = lines_by_key.setdefault(key, {})
        if row["placement"] in placements:
            raise ValueError(f"format_nccl_tests: two {row['placement']} rows for size {row['size_bytes']}")
        placements[row["placement"]] = row
    return lines_by_key


def _preamble(program: str, header: Mapping[str, Any], sizes: list[int]) -> list[str]:
    """The lines before the column header: versions, the test's start, its settings and its devices."""
    out: list[str] = []
    if header.get("nccl_version"):
        code = _version_code(header["nccl_version"])
        out.append(f"# nccl-tests version {header.get('nccl_tests_version', 'layoutlab')} "
                   f"nccl-headers={code} nccl-library={code}")
    out.append(f"# Collective test starting: {program}")
    if "step_bytes" in header:
        step, step_kind = header["step_bytes"], "bytes"
    else:
        step, step_kind = header.get("step_factor", _step_factor(sizes)), "factor"
    nthread_line = (f"# nThread {header.get('nthreads', 1)} nGpus {header.get('ngpus', 1)} "
                    f"minBytes {header.get('min_bytes', min(sizes, default=0))} "
                    f"maxBytes {header.get('max_bytes', max(sizes, default=0))} step: {step}({step_kind}) "
                    f"warmup iters: {header.get('warmup_iters', 1)} iters: {header.get('iters', 20)} "
                    f"agg iters: {header.get('agg_iters', 1)} validation: {header.get('validation', 1)} "
                    f"graph: {header.get('graph', 0)}")
    if "unalign" in header:
        nthread_line += f" unalign: {header['unalign']}"
    out += [nthread_line, "#", "# Using devices"]
    for d in header.get("devices", []):
        # The three device-line forms nccl-tests and rccl-tests have printed, so what was read is written.
        if d.get("group") is not None:
            who = "#  Rank %2d Group %2d Pid %6d" % (d["rank"], d["group"], d.get("pid") or 0)
        elif d.get("pid") is not None:
            who = "#   Rank %2d Pid %6d" % (d["rank"], d["pid"])
        else:
            who = "#   Rank %2d" % d["rank"]
        out.append("%s on %10s device %2d [%s] %s" % (who, d["host"], d["device"], d.get("busid", ""),
                                                      d.get("name", "")))
    out.append("#")
    return out


def _column_header(in_place_only: bool) -> list[str]:
    """The three column-header lines: placements, field names, units."""
    blank = "# %10s  %12s  %8s  %6s  %6s" % ("", "", "", "", "")
    if in_place_only:
        return [blank + "           in-place          ",
                "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s" % (
                    "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"),
                "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s" % (
                    "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")]
    return [blank + "           out-of-place                       in-place          ",
            "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % (
                "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "time", "algbw", "busbw", "#wrong"),
            "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % (
                "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "")]


def _step_factor(sizes: list[int]) -> int:
    ratios = {b // a for a, b in zip(sizes, sizes[1:]) if a > 0 and b % a == 0}
    return ratios.pop() if len(ratios) == 1 else 2
