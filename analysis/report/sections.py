"""The report's sections: a `Report` (analysis.report.data) as a list of `Block`s (headings, text, tables, figures)
that both renderers (analysis.report.render) write; numbers are formatted here, never computed."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from analysis.analyzers import curves as C
from analysis.analyzers import doctor as D
from analysis.analyzers.collectives import NCCL_TESTS_OP
from analysis.analyzers.distributions import PER_RANK_ROWS_MAX
from analysis.report import answer as A
from analysis.report import plots
from analysis.report.data import (
    CPU_BASIS,
    MAX_WARNINGS_SHOWN,
    Report,
    RunResult,
    Trainable,
    bar_segments,
    flops_formulas,
)
from launch.run.metrics import FLOPS_FORMULA, FLOPS_FORMULA_ADAPTERS, FLOPS_SHORT

# What an empty trace section tells the user to do about it.
FILL_TRACE = ("To fill it: run with run.profile=torch (a Kineto trace per rank of run.profile_active_steps steps) or "
              "run.profile=nsys, or pass the ranks' traces (Kineto JSON, nsys SQLite exports) as inputs.")


def nice_bytes(n: Any) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.{digits}g}"
        return f"{x:,.{max(0, digits - len(str(int(abs(x)))))}f}" if abs(x) >= 1 else f"{x:.{digits}g}"
    return str(x)


def _ms(s: Any) -> str:
    return "–" if s is None else f"{s * 1e3:,.1f}"


def _us(us: Any) -> str:
    return "–" if us is None else f"{us:,.0f}"


def _us_ms(us: Any) -> str:
    return "–" if us is None else f"{us / 1e3:,.2f}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{x:.1f}"


def _count(n: Any) -> str:
    """A parameter count as people say it, three significant digits: 12.3K, 4.2M, 6.74B."""
    if n is None:
        return "–"
    rounded = float(f"{n:.3g}")  # 999,950 is 1M, not 1e+03K
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(rounded) >= scale:
            return f"{rounded / scale:g}{unit}"
    return f"{n:,}"


def _parameters(t: Trainable) -> str:
    """'4.2M trainable / 6.74B frozen (0.06%)'; a share too small for two decimals keeps one significant digit."""
    if t.trainable_params is None and t.frozen_params is None:
        return "–"
    pct = t.trainable_pct
    share = "" if pct is None else f" ({pct:.2f}%)" if pct == 0 or pct >= 0.005 else f" ({pct:.1g}%)"
    return f"{_count(t.trainable_params)} trainable / {_count(t.frozen_params)} frozen{share}"


def _fine_tune(t: Trainable) -> str:
    if t.fine_tune is None:
        return "–"
    if not t.fine_tune:
        return "none (every parameter trains)"
    return f"{t.peft.method}, rank {t.peft.rank}, on {', '.join(t.peft.target_modules)}"


def _files(text: str) -> str:
    """A list of files (', '-joined) as it reads in a cell: one file per rank as one pattern ('traces/rank*.json
    (4 files)'), else whole up to PER_RANK_ROWS_MAX names, else the first and the last and how many."""
    names = text.split(", ")
    patterns = {re.sub(r"\d+", "*", n) for n in names}
    if len(names) > 2 and len(patterns) == 1:
        return f"{patterns.pop()} ({len(names):,} files)"
    if len(names) <= PER_RANK_ROWS_MAX:
        return text
    return f"{names[0]}, {names[1]} … {names[-1]} ({len(names):,} files)"


# The quantities shown as distributions over ranks (data.SPREAD), each with its label (unit included) and format.
_SPREAD_LABELS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "span_us": ("span, µs", _us), "compute_pct": ("compute %", _pct), "exposed_comm_pct": ("exposed comm %", _pct),
    "other_pct": ("other %", _pct), "idle_pct": ("idle %", _pct), "overlap_pct": ("overlap %", _pct),
    "comm_time_us": ("communication, µs", _us), "exposed_us": ("exposed, µs", _us),
    "exposed_pct_of_span": ("exposed % of span", _pct), "time_us": ("time, µs", _us),
    "share_pct": ("share of the rank %", _pct), "step_time_us": ("median step, µs", _us),
    "step_excess_pct": ("step excess %", _pct), "comm_deficit_pct": ("comm deficit %", _pct),
    "last_pct": ("arrived last, % of calls", _pct), "late_us": ("late, µs", _us), "wait_us": ("waited, µs", _us),
    "measured_bytes": ("peak", lambda b: nice_bytes(b)), "pct_of_device": ("% of device", _pct),
}


def _spread(rep: Report, key: str, grouped_by: str = "") -> list[Block]:
    """One row per run of several ranks (and per `grouped_by` value): each quantity of `key` (a RunResult.distributions
    key) as its median over the ranks, its range, and the rank furthest on its bad side."""
    quantities: dict[str, None] = {}
    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in rep.runs:
        for d in r.distributions[key].rows() if key in r.distributions else ():
            quantities[d["quantity"]] = None
            row = rows.setdefault((r.label, d["group"]), {"ranks": d["ranks"], "source": r.run.relabel(d["source"])})
            row[d["quantity"]] = d
    if not rows:
        return []

    def cell(d: dict | None) -> str:
        if d is None:
            return "–"
        _, fmt = _SPREAD_LABELS[d["quantity"]]
        rank, _worst = d["worst"][0]
        return f"{fmt(d['median'])} ({fmt(d['min'])}–{fmt(d['max'])}; {d['bad']}est rank {_num(rank)})"

    table = [[label, *([group] if grouped_by else []), _num(row["ranks"]), *(cell(row.get(q)) for q in quantities),
              _files(row["source"])] for (label, group), row in rows.items()]
    return [Block("p", f"A row per run of several ranks: each quantity's median over its ranks, then its range and the "
                       f"rank furthest on the bad side (every rank's row, for runs of up to {PER_RANK_ROWS_MAX} ranks, "
                       f"in the appendix; the three worst ranks in the doctor's findings)."),
            Block("table", headers=["run", *([grouped_by] if grouped_by else []), "ranks",
                                    *(_SPREAD_LABELS[q][0] for q in quantities), "source"], rows=table)]


def _per_rank(r: RunResult, key: str) -> bool:
    """Whether the run's `key` table is shown a row per rank in its section (one rank: its row is the run's; else the
    run's row is its distribution: _spread)."""
    return key not in r.distributions


def _folded(r: RunResult, key: str) -> bool:
    """Whether the run's per-rank rows of `key` are kept in the appendix (Block "fold"): runs of several ranks, up to
    PER_RANK_ROWS_MAX; larger runs read as their distribution alone."""
    t = getattr(r, key)
    return key in r.distributions and t is not None and len(set(t.columns["rank"])) <= PER_RANK_ROWS_MAX


def _fold(title: str, headers: Sequence[str], rows: list) -> list[Block]:
    return [Block("fold", f"{title}, every rank", headers=headers, rows=rows)] if rows else []


@dataclass
class Block:
    """A unit of rendered content: a heading, text, a table or a figure."""

    kind: str  # h2 | h3 | p | table | img | list | details | fold (a table of detail: the appendix, or <details>)
    text: str = ""
    headers: Sequence[str] = ()
    rows: Sequence[Sequence[str]] = ()
    png: bytes = b""
    items: Sequence[str] = ()


def _runs_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Runs")]
    rows = []
    for r in rep.runs:
        lay = r.layout
        stated = ((k, getattr(lay, k)) for k in ("backend", "tp", "pp", "dp", "zero_stage", "sp", "micro_batch_size",
                                                 "global_batch_size", "seq_len", "dtype"))
        desc = ", ".join(f"{k}={v}" for k, v in stated if v is not None)
        counts = f"parameters: {r.trainable.source}" if r.trainable.source else ""
        rows.append([r.label, str(r.run.root), "our run directory" if r.run.run_dir else "foreign files",
                     desc or "unknown", lay.hardware or "unknown", _parameters(r.trainable), _fine_tune(r.trainable),
                     str(len(r.run.files)), str(len(r.run.skipped)),
                     "; ".join(s for s in (lay.source, counts) if s) or "–"])
    out.append(Block("table", headers=["run", "path", "kind", "layout", "hardware",
                                       "parameters: trainable / frozen (trainable %)", "fine-tune (recipe.peft)",
                                       "files used", "skipped", "source"], rows=rows))
    if rep.inputs_missing:
        out.append(Block("list", "Inputs not found", items=rep.inputs_missing))
    apart = [f"{r.label}: {r.run.segment}" for r in rep.runs if r.run.segment]
    if apart:
        out.append(Block("list", "Several runs in one file, each reported as a run of its own", items=apart))
    pooled = [f"{r.label}: {r.run.relabel(b)}" for r in rep.runs for b in r.boundaries]
    if pooled:
        out.append(Block("list", "Several runs in one file (split the file to compare them)", items=pooled))
    unused = [f"{r.label}: {u}" for r in rep.runs for u in r.unused]
    if unused:
        out.append(Block("list", "Logs not used", items=unused))
    warned = [(r.label, r.run.warnings) for r in rep.runs if r.run.warnings]
    if warned:
        out.append(Block("h3", "Warnings (partial inputs)"))
        for label, ws in warned:
            shown = list(ws[:MAX_WARNINGS_SHOWN])
            if len(ws) > MAX_WARNINGS_SHOWN:
                shown.append(f"… {len(ws) - MAX_WARNINGS_SHOWN} more")
            out.append(Block("list", f"{label}: {len(ws)} warning(s)", items=shown))
    return out


def _files_blocks(rep: Report) -> list[Block]:
    """The inventory, last: every file each run's numbers came from, ours not analysed, and what was skipped."""
    out = [Block("h2", "Files read")]
    for r in rep.runs:
        items = [f"{p} — {', '.join(k)}" for p, k in r.run.files]
        ours = [f"{p} — ours, not evidence: {what}" for p, what in r.run.ours]
        skipped = [f"{p} — skipped: {why}" for p, why in r.run.skipped]
        out.append(Block("details", f"{r.label}: {len(items)} file(s) used, {len(ours)} of ours not analysed, "
                                    f"{len(skipped)} skipped", items=items + ours + skipped))
    return out


def _doctor_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Doctor")]
    if not rep.findings:
        out.append(Block("p", "No rule fired. Rules and thresholds are listed under Definitions."))
        return out
    rows = [[f.run, f.severity, f.rule, f.message, " · ".join(f.evidence), f.fix] for f in rep.findings]
    out.append(Block("table", headers=["run", "severity", "rule", "finding", "evidence (file: numbers)", "fix"],
                     rows=rows))
    return out


# Short names of the FLOP counts the meta records name (launch.run.metrics), for where runs count differently.
_FLOPS_COUNTS = {FLOPS_FORMULA: f"full training, {FLOPS_SHORT[FLOPS_FORMULA]}",
                 FLOPS_FORMULA_ADAPTERS: f"a [peft] fine-tune's own FLOPs, {FLOPS_SHORT[FLOPS_FORMULA_ADAPTERS]}"}


def _mfu_title(rep: Report) -> str:
    """The MFU formula list's title; where the runs count FLOP/token differently (a fine-tune counts the FLOPs it does,
    fewer than a full step of its model), which run counts what."""
    by = flops_formulas(rep)
    if len(by) < 2:
        return "MFU formula"
    counts = "; ".join(f"{', '.join(runs)}: {_FLOPS_COUNTS.get(f, f)}" for f, runs in by.items())
    return (f"MFU formula: the runs count FLOP/token differently, so their MFU % measure different work ({counts}); "
            "each run's formula")


def _mfu_header(rep: Report) -> str:
    return "MFU % (FLOP/token differs: MFU formula)" if len(flops_formulas(rep)) > 1 else "MFU %"


def _speed_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "How fast")]
    rows, series = [], []
    for r in rep.runs:
        if r.stats is None or not len(r.stats):
            rows.append([r.label] + ["–"] * 9 + ["no step records (metrics, Megatron or DeepSpeed lines)", "–"])
            continue
        s = next(r.stats.rows())
        p10, p90 = s.get("step_time_p10_s"), s.get("step_time_p90_s")
        rows.append([r.label, _ms(s.get("step_time_median_s")),
                     f"{_ms(p10)}–{_ms(p90)}" if p10 is not None and p90 is not None else "n/a",
                     _ms(s.get("step_time_mean_s")), _pct(s.get("step_time_cv_pct")),
                     _num(s.get("tokens_per_s_per_device")), _num(s.get("tflops_per_device")), _pct(s.get("mfu_pct")),
                     f"{s['steps_measured']} / {s['steps_dropped']}", s["drop_rule"], s["step_source"],
                     r.run.relabel(s["source"])])
        if r.step_times:
            series.append((r.label, [t for _, t, _ in r.step_times]))
    out.append(Block("table", headers=["run", "step time median, ms", "p10–p90, ms", "mean, ms", "CV %",
                                       "tokens/s/GPU", "TFLOP/s/GPU", _mfu_header(rep), "steps measured / dropped",
                                       "warm-up rule", "step time from", "source"], rows=rows))
    out += _startup_blocks(rep)
    formulas: dict[str, list[str]] = {}  # each formula once, with the runs that use it
    for r in rep.runs:
        if r.stats is not None and len(r.stats) and next(r.stats.rows())["mfu_formula"]:
            formulas.setdefault(next(r.stats.rows())["mfu_formula"], []).append(r.label)
    if formulas:
        out.append(Block("list", _mfu_title(rep), items=[f"{f} ({', '.join(runs)})" for f, runs in formulas.items()]))
    prof = [[r.label, str(p["step"] if p["step"] is not None else "–"), _sci(p["params_per_gpu"]),
             _sci(p["fwd_macs_per_gpu"]), _num(p["fwd_latency_ms"]), _num(p["bwd_latency_ms"]),
             _num(p["step_latency_ms"]), _num(p["iter_latency_ms"]),
             *(_tflops(p[k]) for k in ("fwd_flop_per_s_per_gpu", "bwd_flop_per_s_per_gpu", "fwd_bwd_flop_per_s_per_gpu",
                                       "flop_per_s_per_gpu")), _num(p["samples_per_s"]),
             r.run.relabel(f"{log.source}:{p['line']}")]
            for r in rep.runs for log in r.run.deepspeed for p in log.rows() if p["kind"] == "flops_profile"]
    thr = []
    for r in rep.runs:
        for log in r.run.deepspeed:
            rows_ = [x for x in log.rows() if x["kind"] == "throughput" and x["samples_per_s"] is not None]
            if rows_:
                last = rows_[-1]
                thr.append([r.label, str(len(rows_)), _num(last["samples_per_s"]), _num(last["samples_per_s_avg"]),
                            str(last["step"] if last["step"] is not None else "–"),
                            r.run.relabel(f"{log.source}:{last['line']}")])
    if thr:
        out.append(Block("h3", "DeepSpeed's own throughput"))
        out.append(Block("table", headers=["run", "records", "samples/s (last step)", "samples/s (running average)",
                                           "at step", "source"], rows=thr))
    if prof:
        out.append(Block("h3", "DeepSpeed Flops Profiler"))
        out.append(Block("table", headers=["run", "step", "params/GPU", "fwd MACs/GPU", "fwd ms", "bwd ms", "step ms",
                                           "iter ms", "fwd TFLOP/s/GPU", "bwd TFLOP/s/GPU", "fwd+bwd TFLOP/s/GPU",
                                           "iter TFLOP/s/GPU", "samples/s", "source"], rows=prof))
    if series:
        out.append(Block("img", "Step-time distribution of the measured window (box: quartiles; points: steps). "
                                "Sources: the files in the table's source column.",
                         png=_plot(plots.step_time_distribution, series)))
    return out


def _startup_blocks(rep: Report) -> list[Block]:
    """Each run's start-up per rank and what its checkpoint saves cost training, where our metrics recorded them."""
    rows = []
    for r in rep.runs:
        st = r.startup
        if st is None:
            continue
        slow = st.slowest_rank
        rows.append([r.label, _num(st.startup_s[slow]) if slow is not None else "–", str(slow) if slow is not None else "–",
                     _num(st.median_startup_s), str(st.saves),
                     {True: "asynchronous", False: "synchronous", None: "–"}[st.asynchronous],
                     _num(st.blocked_median_s), _num(st.blocked_max_s), r.run.relabel(st.source)])
    if not rows:
        return []
    return [Block("h3", "Start-up and checkpoint saves"),
            Block("table", headers=["run", "start-up, slowest rank, s", "slowest rank", "start-up, median rank, s",
                                    "checkpoint saves", "saved", "training blocked per save, median, s",
                                    "blocked, longest, s", "source"], rows=rows)]


def _sci(x: Any) -> str:
    return "–" if x is None else f"{x:.3g}"


def _tflops(flop_per_s: Any) -> str:
    # The profiler prints a rate with two decimals in its own unit (`137.17 TFLOPS`, `512.34 GFLOPS`): five
    # significant digits of TFLOP/s keep every digit it printed.
    return "–" if flop_per_s is None else f"{flop_per_s / 1e12:.5g}"


def _last_validation(curves) -> str:
    points = [(s, v) for s, v in zip(curves.columns["step"], curves.columns["valid_loss"], strict=True) if v is not None]
    return f"{_num(points[-1][1], 4)} (step {points[-1][0]}, {len(points)} evaluations)" if points else "–"


def _curve_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Training curves")]
    rows, series = [], []
    for r in rep.runs:
        if r.curves is None:
            rows.append([r.label, "0"] + ["–"] * 6 + ["no loss per step (metrics, Megatron, TensorBoard or DeepSpeed "
                                                      "pipeline lines)"])
            continue
        c = C.summarise(r.curves)
        rows.append([r.label, f"{c.steps} ({c.first_step}–{c.last_step})",
                     f"{_num(c.loss_first, 4)} → {_num(c.loss_last, 4)} (min {_num(c.loss_min, 4)})"
                     + (f"; {c.not_finite} not finite" if c.not_finite else ""),
                     _last_validation(r.curves),
                     f"{_num(c.grad_norm_last)} (max {_num(c.grad_norm_max)})" if c.grad_norm_last is not None else "–",
                     f"{_sci(c.lr_first)} → {_sci(c.lr_last)} (max {_sci(c.lr_max)})" if c.lr_first is not None else "–",
                     _num(c.loss_scale_last) if c.loss_scale_last is not None else "–",
                     str(c.skipped) if c.skipped is not None else "–", r.run.relabel(r.curves.source) or "–"])
        series.append((r.label, list(r.curves.columns["step"]),
                       {k: list(r.curves.columns[k]) for k in ("loss", "valid_loss", "grad_norm", "lr")}))
    out.append(Block("table", headers=["run", "steps logged", "loss first → last", "validation loss last",
                                       "grad norm last", "lr first → last",
                                       "loss scale last", "skipped iterations", "source"], rows=rows))
    if rep.curve_pairs:
        out.append(Block("h3", "Loss against the first run"))
        out.append(Block("table", headers=["run", "against", "steps compared", "max |Δ loss|", "max |Δ loss| / loss %",
                                           "at step", "mean |Δ loss|", "expected to agree", "source"],
                         rows=[[p.other, p.first, str(p.comparison.common_steps), _sci(p.comparison.max_abs_diff),
                                _sci(None if p.comparison.max_rel_diff is None else 100 * p.comparison.max_rel_diff),
                                str(p.comparison.at_step) if p.comparison.at_step is not None else "–",
                                _sci(p.comparison.mean_abs_diff),
                                f"yes: {C.AGREE_SUMMARY}" if not p.not_comparable
                                else f"no: {p.not_comparable}", p.sources] for p in rep.curve_pairs]))
    val = [[r.label, "–" if v.iteration is None else str(v.iteration), v.what or "–", _num(v.loss, 4), _sci(v.ppl),
            r.run.relabel(v.source)] for r in rep.runs for v in r.validation]
    if val:
        out.append(Block("h3", "Validation"))
        out.append(Block("table", headers=["run", "iteration", "set", "loss", "PPL", "source"], rows=val))
    if series:
        out.append(Block("img", "Loss, gradient norm and learning rate per step, every run overlaid. Sources: the "
                                "table's source column.", png=_plot(plots.training_curves, series)))
    return out


def _memory_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Memory")]
    rows, groups, folded = [], [], []
    dev = None
    for r in rep.runs:
        if r.memory is None or not len(r.memory):
            rows.append([r.label, "–", "–", "no memory records", "–", "–", "–", "–", "–", "–"])
            continue
        ranks = []
        for m in r.memory.rows():
            row = [r.label, _num(m["rank"]), nice_bytes(m["measured_bytes"]), m["measured_what"],
                   nice_bytes(m["predicted_bytes"]), _num(m["measured_over_predicted"]),
                   nice_bytes(m["device_memory_bytes"]), _pct(m["pct_of_device"]),
                   r.run.relabel(m["predicted_what"] or "–"), r.run.relabel(m["source"] or "–")]
            if _per_rank(r, "memory"):
                rows.append(row)
            elif _folded(r, "memory"):
                folded.append(row)
            ranks.append((_num(m["rank"]), m["measured_bytes"] / 2**30,
                          m["predicted_bytes"] / 2**30 if m["predicted_bytes"] else None))
            dev = dev or m["device_memory_bytes"]
        groups.append((r.label, ranks))
    headers = ["run", "rank", "peak", "measured as", "predicted", "measured / predicted", "device", "% of device",
               "prediction from", "source"]
    if rows or not any("memory" in r.distributions for r in rep.runs):
        out.append(Block("table", headers=headers, rows=rows))
    out += _spread(rep, "memory") + _fold("Memory", headers, folded)
    if groups:
        same_dev = len({m["device_memory_bytes"] for r in rep.runs if r.memory is not None
                        for m in r.memory.rows()}) == 1
        out.append(Block("img", "Peak memory per rank (bars) against the planner's prediction (black ticks)"
                                + (" and the device memory (dashed)" if same_dev and dev else ""),
                         png=_plot(plots.memory_per_rank, groups, dev / 2**30 if same_dev and dev else None)))
    return out


def _time_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Where the time went")]
    rows, bars, folded = [], [], []
    for r in rep.runs:
        if r.breakdown is None:
            continue
        for b in r.breakdown.rows():
            row = [r.label, _num(b["rank"]), b["basis"], _us(b["span_us"]), _us(b["compute_us"]),
                   _pct(b["compute_pct"]), _pct(b["recompute_pct"]), _us(b["non_compute_us"]),
                   _pct(b["non_compute_pct"]), _pct(b["exposed_comm_pct"]), _pct(b["other_pct"]), _us(b["idle_us"]),
                   _pct(b["idle_pct"]), _us(b["comm_us"]), _pct(b["overlap_pct"]), r.run.relabel(b["source"])]
            (rows if _per_rank(r, "breakdown") else folded if _folded(r, "breakdown") else []).append(row)
        bars.append((r.label, bar_segments(r)))
    if bars:
        # HTA's temporal breakdown as it prints it, absolute times in µs beside the shares; the non-compute share
        # then splits into exposed communication and other activity.
        headers = ["run", "rank", "basis", "span, µs", "compute, µs", "compute %", "of which recompute %",
                   "non-compute, µs", "non-compute %", "of which exposed comm %", "of which other %", "idle, µs",
                   "idle %", "comm, µs", "overlap %", "source"]
        if rows:
            out.append(Block("table", headers=headers, rows=rows))
        out += _spread(rep, "breakdown") + _fold("Where the time went", headers, folded)
        out.append(Block("img", "Share of the measured span per run (mean over ranks): compute, each collective's "
                                "exposed time, other non-compute activity, idle. Sources: the trace files above.",
                         png=_plot(plots.time_breakdown_bars, bars)))
        ex_rows, ex_folded = [], []
        for r in rep.runs:
            if r.exposed is None:
                continue
            for e in r.exposed.rows():
                row = [r.label, _num(e["rank"]), e["collective"], e["basis"], _us_ms(e["comm_time_us"]),
                       _us_ms(e["exposed_us"]), _pct(e["exposed_pct_of_span"]), r.run.relabel(e["source"])]
                (ex_rows if _per_rank(r, "exposed") else ex_folded if _folded(r, "exposed") else []).append(row)
        ex_spread = _spread(rep, "exposed", "collective")
        if ex_rows or ex_spread:
            out.append(Block("h3", "Exposed communication per collective"))
        ex_headers = ["run", "rank", "collective", "basis", "time, ms", "exposed, ms", "exposed % of span", "source"]
        if ex_rows:
            out.append(Block("table", headers=ex_headers, rows=ex_rows))
        out += ex_spread + _fold("Exposed communication per collective", ex_headers, ex_folded)
        kt_rows, kt_folded = [], []
        for r in rep.runs:
            for k in r.kernel_types.rows() if r.kernel_types is not None else ():
                row = [r.label, _num(k["rank"]), k["kernel_type"], f"{k['time_us']:,.0f}", _pct(k["share_pct"]),
                       r.run.relabel(r.kernel_types.source)]
                (kt_rows if _per_rank(r, "kernel_types") else kt_folded if _folded(r, "kernel_types") else []).append(row)
        kt_spread = _spread(rep, "kernel_types", "kernel type")
        if kt_rows or kt_spread:
            out.append(Block("h3", "GPU kernel types (HTA's get_gpu_kernel_breakdown)"))
        kt_headers = ["run", "rank", "kernel type", "time, µs", "share of the rank %", "source"]
        if kt_rows:
            out.append(Block("table", headers=kt_headers, rows=kt_rows))
        out += kt_spread + _fold("GPU kernel types", kt_headers, kt_folded)
        notes = sorted({f"{r.label}: {n}" for r in rep.runs for n in r.notes})
        if notes:
            out.append(Block("list", "Basis of the numbers", items=notes))
    else:
        out.append(Block("p", "No profiler trace (Kineto or nsys export) in any run: no timeline breakdown. " + FILL_TRACE))
    for r in rep.runs:
        for t in r.timers:
            out.append(Block("h3", f"{r.label}: framework timers ({r.run.relabel(t.source)})"))
            out.append(Block("table", headers=["timer", "category", "mean, ms", "max, ms", "records", "source"],
                             rows=[[x["name"], x["category"], _num(x["mean_ms"]), _num(x["max_ms"]), _num(x["samples"]),
                                    r.run.relabel(x["source"])] for x in list(t.rows())[:25]]))
        for t in r.nsys_totals:
            out.append(Block("h3", f"{r.label}: GPU time from nsys stats (sums, no timeline)"))
            out.append(Block("table", headers=["kind", "collective", "instances", "total, ms", "share %", "source"],
                             rows=[[x["kind"], x["collective"] or "–", _num(x["instances"]), _num(x["total_ms"]),
                                    _pct(x["share_pct"]), r.run.relabel(x["source"])] for x in t.rows()]))
    return out


def _collective_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Collectives")]
    rows, points, curves = [], [], {}
    observed_ops = set()
    for r in rep.runs:
        if r.bandwidth is None:
            continue
        for b in r.bandwidth.rows():
            observed_ops.add(NCCL_TESTS_OP.get(b["collective"]))
            rows.append([r.label, b["collective"], _num(b["calls_per_step"]), _num(b["time_per_step_ms"]),
                         nice_bytes(b["mean_message_bytes"]), f"{_num(b['group_size'])} ({b['group_size_from']})",
                         _num(b["busbw_GBps"]), _num(b["busbw_large_GBps"]),
                         _num(b["ceiling_GBps"]) + (f" at {nice_bytes(b['ceiling_at_bytes'])}"
                                                    if b["ceiling_at_bytes"] is not None else ""),
                         _pct(b["pct_of_ceiling"]),
                         r.run.relabel(b["ceiling_source"]) + (f" ({b['ceiling_note']})" if b["ceiling_note"] else ""),
                         b["basis"],
                         _files(r.run.relabel(b["source"]))])
        if r.busbw_points:
            points.append((r.label, r.busbw_points))
    for r in rep.runs:
        for op, src, pts in r.ceiling_curves:
            if op in observed_ops or not observed_ops:
                curves.setdefault((op, src), (f"nccl-tests {op} ({r.run.relabel(src)})", pts))
    if rows:
        out.append(Block("table", headers=["run", "collective", "calls/step", "time/step, ms", "mean message",
                                           "group size", "busbw, GB/s", "busbw ≥1 MiB, GB/s", "nccl-tests ceiling, GB/s",
                                           "% of ceiling", "ceiling source", "counted from", "source"], rows=rows))
    else:
        out.append(Block("p", "No collective calls found (no profiler trace). " + FILL_TRACE))
    out.append(Block("p", rep.ceiling_note + "; ceiling = the sweep's busbw at the calls' mean message size (those "
                                             "of at least 1 MiB where any), interpolated in log size; the ceiling "
                                             "source says when the sweep ran on another rank count. The table below "
                                             "gives each sweep's large-message busbw (median over the top quartile "
                                             "of sizes) for reference."))
    ceil_rows = []
    for r in rep.runs:
        if r.ceilings is not None:
            for c in r.ceilings.rows():
                ceil_rows.append([r.label, c["op"], _num(c["busbw_GBps"]), _num(c["peak_busbw_GBps"]),
                                  _num(c["nranks"]), r.run.relabel(c["source"])])
    if ceil_rows:
        out.append(Block("table", headers=["run", "nccl-tests op", "large-message busbw, GB/s", "peak busbw, GB/s",
                                           "ranks", "source"], rows=ceil_rows))
    if points or curves:
        fewer = [f"{r.label}: the calls of {r.busbw_ranks[0]} of its {r.busbw_ranks[1]:,} ranks with sized calls"
                 for r in rep.runs if r.busbw_ranks[0] < r.busbw_ranks[1]]
        out.append(Block("img", "Achieved bus bandwidth per call vs message size (points) and the nccl-tests sweeps "
                                "(lines)" + (f" ({'; '.join(fewer)})" if fewer else ""),
                         png=_plot(plots.busbw_vs_size, points, list(curves.values())[:8])))
    out += _arrival_blocks(rep)
    lay_rows = []
    for r in rep.runs:
        if r.vs_layout is None:
            continue
        for v in r.vs_layout.rows():
            lay_rows.append([r.label, v["collective"], _num(v["observed_per_step"]),
                             f"{v['expected_min_per_step']}–{v['expected_max_per_step']}", _num(v["layers"]),
                             _num(v["observed_per_layer"]), _num(v["excess_per_layer"]), v["why"],
                             r.run.relabel(v["source"])])
    out.append(Block("h3", "Collective counts against the layout"))
    if lay_rows:
        out.append(Block("table", headers=["run", "collective", "observed/step", "layout explains/step", "layers",
                                           "observed/layer", "excess/layer", "why", "source"], rows=lay_rows))
    else:
        out.append(Block("p", "No run has both a trace and a resolved layout; foreign runs have no expectation. "
                              + FILL_TRACE))
    return out


def _arrival_blocks(rep: Report) -> list[Block]:
    """Where each collective waited (analysis.analyzers.arrivals), per run and collective type."""
    rows = [[r.label, a["collective"], _num(a["calls"]), _num(a["ranks"]), _us_ms(a["skew_us"]),
             _us_ms(a["transfer_us"]), _pct(a["skew_pct"]), _us(a["mean_skew_us"]), _us(a["max_skew_us"]),
             f"{_num(a['last_rank'])} ({_pct(a['last_rank_pct'])}% of calls)" if a["last_rank"] is not None
             else "none (the latest start shared)", a["mostly"], a["matched_by"],
             _files(r.run.relabel(a["source"]))]
            for r in rep.runs if r.arrivals is not None for a in r.arrivals.rows()]
    if not rows:
        return []
    return [Block("h3", "Where each collective waited"),
            Block("table", headers=["run", "collective", "matched calls", "ranks per call", "arrival skew, ms",
                                    "transfer, ms", "skew % of time", "mean skew, µs", "max skew, µs",
                                    "last to arrive (rank)", "mostly", "matched by", "source"], rows=rows),
            Block("p", "Each call is matched across the ranks that made it (by process group and the recorded "
                       "sequence number 'Seq', else as the k-th call of its collective in its ProfilerStep; "
                       "point-to-point calls are left out). Arrival skew = last rank's start − first rank's start; "
                       "transfer = last rank's end − last rank's start; their sum is the call's time from the first "
                       "arrival to the last end. Mostly 'arrival skew': the calls wait on a late rank, not on the "
                       "wire. Ranks on different hosts compare only as well as their clocks agree.")]


def _comm_file_blocks(rep: Report) -> list[Block]:
    out = []
    rows = [[r.label, n["op"], f"{n['ranks']} ({n['ranks_from']})" if n["ranks"] is not None else "unknown",
             nice_bytes(n["size_bytes"]), str(n["count"]), str(n["dtype"]), str(n["redop"] or "–"),
             _sci(n["oop_time_us"]), _sci(n["oop_algbw_GBps"]), _sci(n["oop_busbw_GBps"]), _sci(n["ip_time_us"]),
             _sci(n["ip_algbw_GBps"]), _sci(n["ip_busbw_GBps"]), "–" if n["wrong"] is None else str(n["wrong"]),
             r.run.relabel(n["source"])]
            for r in rep.runs for t in r.nccl_rows for n in t.rows()]
    if rows:
        out.append(Block("h3", "nccl-tests per message size"))
        out.append(Block("table", headers=["run", "collective", "ranks", "size", "count", "type", "redop",
                                           "out-of-place µs", "algbw GB/s", "busbw GB/s", "in-place µs",
                                           "algbw GB/s", "busbw GB/s", "#wrong", "source"], rows=rows))
        out.append(Block("table", headers=["run", "collective", "ranks", "sizes printed",
                                           "average busbw as nccl-tests printed it (Avg bus bandwidth), GB/s",
                                           "source"],
                         rows=[[r.label, a.op, f"{a.ranks} ({a.ranks_from})" if a.ranks is not None else "unknown",
                                # %g: the footer's own printf format, so the figure reads as the file does
                                str(a.rows), f"{a.avg_busbw_GBps:g}" if a.avg_busbw_GBps is not None
                                else "printed, but no possible bandwidth (the warnings say what)" if a.footer_printed
                                else "not printed (the output was cut short)", r.run.relabel(a.source)]
                               for r in rep.runs for t in r.nccl_rows for a in t.meta.averages]))
    # NCCL_DEBUG lines come in logs of their own and among an nccl-tests output's rows.
    rows = [[r.label, str(g["comm"] or "–"), f"{g['peer_from']} → {'–' if g['peer_to'] is None else g['peer_to']}",
             str(g["kind"] or "–"), str(g["transport"]), "yes" if g["gdrdma"] else "no", str(g["channels"]),
             str(g["cuda_dev"] or "–"), str(g["hosts"] or "–"), r.run.relabel(g["source"])]
            for r in rep.runs for t in r.transports
            for g in t.rows()]
    if rows:
        out.append(Block("h3", "Transports (NCCL_DEBUG)"))
        out.append(Block("table", headers=["run", "communicator", "ranks", "kind", "transport", "GPUDirect RDMA",
                                           "channels", "device", "hosts", "source"], rows=rows))
    rows = [[r.label, c["comm_op"], nice_bytes(c["message_bytes"]), str(c["count"]), _num(c["total_latency_ms"]),
             _num(c["avg_latency_ms"]), _sci(c["algbw_gbps"]), _sci(c["busbw_gbps"]),
             r.run.relabel(f"{log.source}:{c['line']}")]
            for r in rep.runs for log in r.run.deepspeed for c in log.rows() if c["kind"] == "comms"]
    if rows:
        out.append(Block("h3", "DeepSpeed comms logger (deepspeed.comm.log_summary)"))
        out.append(Block("table", headers=["run", "operation", "message", "calls", "total, ms", "mean, ms",
                                           "algbw, Gbit/s", "busbw, Gbit/s", "source"], rows=rows))
    return out


def _straggler_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Stragglers")]
    rows, folded = [], []
    for r in rep.runs:
        if r.stragglers is None:
            continue
        for s in r.stragglers.rows():
            row = [r.label, _num(s["rank"]), _num(s["steps"]), _us_ms(s["step_time_us"]), _us_ms(s["comm_time_us"]),
                   _pct(s["step_excess_pct"]), _pct(s["comm_deficit_pct"]), "yes" if s["straggler"] else "no",
                   s["reason"] or "–", r.run.relabel(s["source"])]
            if _per_rank(r, "stragglers") or s["straggler"]:  # a flagged rank keeps its row in any run
                rows.append(row)
            if _folded(r, "stragglers"):  # the appendix holds every rank, a flagged one too
                folded.append(row)
    spread = _spread(rep, "stragglers")
    headers = ["run", "rank", "steps", "median step, ms", "comm/step, ms", "step excess %", "comm deficit %",
               "straggler", "reason", "source"]
    if rows or spread:
        if rows:
            out.append(Block("table", headers=headers, rows=rows))
        out += spread + _fold("Stragglers", headers, folded)
        out.append(Block("p", f"Rule (trace_analysis.stragglers, threshold {D.STRAGGLER_PCT:g}%): a rank is compared "
                              f"with the median of the other ranks; slower steps, or less time waiting in collectives "
                              f"than the others (it arrives last), mark it."))
    else:
        out.append(Block("p", "No per-rank traces. " + FILL_TRACE))
    arrived, folded = [], []
    for r in rep.runs:
        for a in r.rank_arrivals.rows() if r.rank_arrivals is not None else ():
            row = [r.label, _num(a["rank"]), _num(a["calls"]), _num(a["last"]), _pct(a["last_pct"]),
                   _us_ms(a["late_us"]), _us_ms(a["wait_us"]), r.run.relabel(a["source"])]
            (arrived if _per_rank(r, "rank_arrivals") else folded if _folded(r, "rank_arrivals") else []).append(row)
    spread = _spread(rep, "rank_arrivals")
    if arrived or spread:
        out.append(Block("h3", "Who the collectives waited for"))
        headers = ["run", "rank", "matched calls", "arrived last", "last, % of calls", "late, ms", "waited, ms",
                   "source"]
        if arrived:
            out.append(Block("table", headers=headers, rows=arrived))
        out += spread + _fold("Who the collectives waited for", headers, folded)
        out.append(Block("p", f"Per rank over the collective calls matched across ranks (Collectives: where each "
                              f"collective waited): late = its start − the first rank's start, waited = the last "
                              f"rank's start − its start, summed. Doctor rule late_rank: last at ≥ "
                              f"{D.LATE_RANK_PCT:g}% of the calls (at least {D.LATE_RANK_MIN_CALLS}) while arrival "
                              f"skew is ≥ {D.SKEW_MIN_PCT:g}% of their time."))
    return out


def _diff_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Kernel diff"), Block("p", rep.kernel_diff_note)]
    if rep.kernel_diff is not None and len(rep.kernel_diff):
        rows = [[d["name"][:120], d["kind"] or "–", _num(d["count_a"]), _num(d["count_b"]), _num(d["time_a_us"]),
                 _num(d["time_b_us"]), _num(d["time_delta_us"]), _pct(d["time_delta_pct"]), rep.kernel_diff.source]
                for d in rep.kernel_diff.rows()]
        out.append(Block("table", headers=["kernel", "kind", "count a", "count b", "time a, µs", "time b, µs",
                                           "Δ time, µs", "Δ %", "source"], rows=rows))
    return out


def _prediction_blocks(rep: Report) -> list[Block]:
    out = [Block("h2", "Prediction vs measurement")]
    rows = []
    for r in rep.runs:
        for p in r.prediction:
            fmt = nice_bytes if p["unit"] == "bytes" else _num
            rows.append([r.label, p["quantity"], fmt(p["predicted"]), p["missing"] or fmt(p["measured"]),
                         p["unit"] if p["unit"] != "bytes" else "", _num(p["measured_over_predicted"]),
                         r.run.relabel(p["source"])])
    if rows:
        out.append(Block("table", headers=["run", "quantity", "predicted", "measured", "unit", "measured / predicted",
                                           "source"], rows=rows))
        notes = sorted({f"{r.label}: {r.run.plan.step.assumptions}" for r in rep.runs if r.run.plan is not None})
        out.append(Block("list", "The planner's assumptions", items=notes))
    else:
        out.append(Block("p", "none: no run has a plan (plan.json or resolved.json); foreign runs have none."))
    return out


def _definitions_blocks(rep: Report) -> list[Block]:
    items = [
        "Warm-up: our runs drop the steps the trainer marked warmup=true (train.warmup_steps, from the meta "
        "record); foreign logs drop the first 10% of the logged step range, at least 10 steps, but never more than "
        "half of the records. The count and rule are given per run.",
        "Step time per step: the slowest rank's record (a synchronous step ends when its last rank does).",
        f"MFU: FLOPs per token x tokens/s/GPU / the hardware profile's dense peak for the dtype; for Megatron logs "
        f"its own TFLOP/s/GPU / peak. FLOPs per token as the meta record's flops_formula names them; full training: "
        f"{FLOPS_FORMULA}. A [peft] fine-tune: {FLOPS_FORMULA_ADAPTERS}.",
        "Time breakdown, gpu_kernels basis: HolisticTraceAnalysis's definitions (temporal breakdown, "
        "comm/comp overlap) on the GPU activity of the profiled steps (the last step dropped when there are "
        "several).",
        "Time breakdown, cpu_ops basis (CPU-only traces): " + CPU_BASIS + ".",
        "busbw: nccl-tests' bus bandwidth = message bytes / time x factor (all_reduce 2(n-1)/n; all_gather, "
        "reduce_scatter, all_to_all (n-1)/n; broadcast, send/recv 1).",
        *[f"Doctor rule {k}: {v}" for k, v in D.RULES.items()],
    ]
    return [Block("h2", "Definitions"), Block("list", "", items=items)]


def answer_lines(ans: A.Answer) -> list[str]:
    """The answer in sentences: per group, the fastest run and its margin (or why the runs race in groups), then each
    slower run's difference and its largest parts."""
    return winner_lines(ans) + [_why_line(w) for g in ans.groups for w in g.why]


def winner_lines(ans: A.Answer) -> list[str]:
    """Per group, the fastest run and its margin, after why the runs race in groups where they do."""
    out = []
    if len(ans.groups) > 1:
        out.append(f"The runs differ in {ans.differs}: each group of runs that share them is ranked on its own "
                   f"({len(ans.groups)} groups).")
    for g in ans.groups:
        fast = g.standings[:g.raced]
        where = f" among runs of {g.shared}" if len(ans.groups) > 1 else ""
        if not fast:
            out.append(f"No step records{where}: nothing to rank.")
        elif g.margin is None:
            out.append(f"{fast[0].label}{where}: {_num(fast[0].tokens_per_s_per_device)} tokens/s/GPU, the only "
                       "run with step records" + ("." if len(g.standings) == 1 else " in its group."))
        else:
            out.append(f"Fastest{where}: {fast[0].label}, {_num(fast[0].tokens_per_s_per_device)} tokens/s/GPU, "
                       f"{g.margin:.1%} ahead of {fast[1].label}.")
    return out


def _why_line(w: A.WhySlower) -> str:
    head = (f"{w.label} is {_ms(w.delta_s)} ms a step slower than {w.best} "
            f"({w.delta_s / w.best_step_s:+.0%})" if w.best_step_s else f"{w.label} vs {w.best}")
    plan = f"; its plan predicted {_ms(w.predicted_delta_s)} ms" if w.predicted_delta_s is not None else ""
    if w.missing:
        return f"{head}: {w.missing}{plan}."
    worse = [p for p in w.parts if p.delta_s >= max(1e-4, 0.05 * w.delta_s)][:2]  # the parts that matter
    named = ", ".join(f"{p.name} {_ms(p.delta_s)} ms" for p in worse) or "no part larger"
    waited = f"; the doctor: {w.waited_for.rule}: {w.waited_for.message}" if w.waited_for else ""
    return f"{head}: most of it {named}{waited}{plan} (traces: {_evidence(w)})."


def _evidence(w: A.WhySlower) -> str:
    return f"{w.label}: {_files(w.sources[0])}; {w.best}: {_files(w.sources[1])}"


def _loss_note(s: A.Standing) -> str:
    """Against which run the loss was compared and its largest relative gap, or why it was not."""
    if s.loss_gap == 0:
        return f"vs {s.loss_against}: equal"
    if s.loss_gap is not None:
        return f"vs {s.loss_against}: ≤ {s.loss_gap:.1%}" if s.loss_gap >= 1e-3 else f"vs {s.loss_against}: ≤ {s.loss_gap:.0e}"
    return f"vs {s.loss_against}: {s.loss_why_not}" if s.loss_against else s.loss_why_not


def _answer_blocks(rep: Report) -> list[Block]:
    """The first screen: the ranking, the winner and why each other run was slower (analysis.report.answer)."""
    ans = A.answer(rep)
    # The winner and the ranking first (the first screen), then why each other run was slower.
    out = [Block("h2", f"The answer: {len(rep.runs)} run(s)"), Block("list", "", items=winner_lines(ans))]
    for g in ans.groups:
        if len(ans.groups) > 1:
            out.append(Block("p", f"Ranked by tokens/s/GPU: runs of {g.shared}."))
        rows = [[str(i + 1), s.label, _ms(s.step_s), _num(s.tokens_per_s_per_device), _pct(s.mfu_pct),
                 _pct(s.memory_pct), {True: "yes", False: "no", None: "–"}[s.loss_agrees], _loss_note(s),
                 f"{s.finding.rule} ({s.finding.severity})" if s.finding else "–", _files(s.source)]
                for i, s in enumerate(g.standings)]
        out.append(Block("table", headers=["#", "run", "step ms (median)", "tokens/s/GPU", _mfu_header(rep),
                                           "peak memory % of device", f"loss agrees (≤ {A.AGREE_REL:.0%})",
                                           "loss compared (largest relative gap)", "most severe finding (Doctor)",
                                           "source"], rows=rows))
        # the parts that differ by a tenth of a millisecond or more somewhere, largest first
        names = [n for n in dict.fromkeys(p.name for w in g.why for p in w.parts)
                 if any(abs(p.delta_s) >= 1e-4 for w in g.why for p in w.parts if p.name == n)]
        split = [[w.label, w.best, _ms(w.delta_s), _ms(w.predicted_delta_s),
                  *(_ms(next((p.delta_s for p in w.parts if p.name == n), None)) for n in names),
                  w.recompute or "–", w.missing or _evidence(w)] for w in g.why]
        if g.why:
            out.append(Block("list", "Why slower than the fastest", items=[_why_line(w) for w in g.why]))
        if split:
            out.append(Block("p", "The split: each part's milliseconds a step, this run's minus the fastest's (the "
                             "traces' shares of the profiled window × the median step; recompute: measured inside the "
                             "trainer's recompute ranges where its traces mark them (the torch backend), else the "
                             "compute share the run's plan attributes to recomputed FLOPs; idle holds a pipeline's "
                             "bubble and the host's gaps, which the traces do not tell apart); plan: the plans' step "
                             "times, the same difference."))
            out.append(Block("table", headers=["run", "fastest", "step +ms", "plan +ms", *names, "recompute from",
                                               "source"], rows=split))
        out += _planned_split(g)
    return out


CONSOLE_LINES = 25  # the answer printed after the report is written: one screen


def console_answer(rep: Report) -> list[str]:
    """The answer for the terminal: each group's ranking as aligned rows, then the sentences; at most CONSOLE_LINES,
    the rest in the report."""
    ans = A.answer(rep)
    lines = []
    for g in ans.groups:
        rows = [(str(i + 1), s.label, _ms(s.step_s), _num(s.tokens_per_s_per_device), _pct(s.mfu_pct),
                 _pct(s.memory_pct), {True: "agrees", False: "DIFFERS", None: "–"}[s.loss_agrees])
                for i, s in enumerate(g.standings)]
        head = ("#", "run", "step ms", "tokens/s/GPU", "MFU %", "mem %", "loss")
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        if len(ans.groups) > 1:
            lines.append(f"runs of {g.shared}:")
        lines += ["  " + "  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in
                                   enumerate(zip(r, widths, strict=True))) for r in [head, *rows]]
    lines += answer_lines(ans)
    if len(lines) > CONSOLE_LINES:
        lines = lines[:CONSOLE_LINES - 1] + [f"... {len(lines) - CONSOLE_LINES + 1} more line(s): the report's first "
                                             "section holds them all"]
    return lines


def _planned_split(g: A.Group) -> list[Block]:
    """The plans' split of each difference, beside the measured one: the same parts where the plan has them."""
    withplan = [w for w in g.why if w.planned_parts]
    if not withplan:
        return []
    names = [p.name for p in withplan[0].planned_parts]
    rows = [[w.label, w.best, _ms(w.predicted_delta_s), *(_ms(p.delta_s) for p in w.planned_parts),
             "plan.json of each run"] for w in withplan]
    return [Block("p", "The plans' split of the same differences, ms a step (compute and recompute by their FLOPs; "
                       "exposed communication: the collectives on the plan's critical path, all kinds together; the "
                       "pipeline bubble, which traces count as idle; offload traffic)."),
            Block("table", headers=["run", "fastest", "plan +ms", *names, "source"], rows=rows)]


def report_blocks(rep: Report) -> list[Block]:
    return (_answer_blocks(rep) + _runs_blocks(rep) + _doctor_blocks(rep) + _speed_blocks(rep) + _curve_blocks(rep) + _memory_blocks(rep)
            + _time_blocks(rep) + _collective_blocks(rep) + _comm_file_blocks(rep) + _straggler_blocks(rep) + _diff_blocks(rep)
            + _prediction_blocks(rep) + _files_blocks(rep) + _definitions_blocks(rep))


def _plot(draw: Callable[..., bytes], *args: Any) -> bytes:
    """One figure: `draw` (a function of analysis.report.plots) on the numbers given; the one place figures are
    drawn from, so that a test can leave them out."""
    return draw(*args)
