"""How a plan and a launch command look on the console: the plan tables, the node lines, units and the escaping
of the user's own text. Computing lives in launch/plan; this module only shows."""
from __future__ import annotations

import os
from typing import Sequence

from launch.config import adapters, calibration as cal
from launch.config.backends import BACKENDS
from launch.config.resolve import Resolved
from launch.errors import printable
from launch.plan.layout import Plan
from launch.plan.memory import chunk_layers
from launch.run import launcher
from launch.run.metrics import FLOPS_SHORT, flops_formula
from launch.units import GiB, KiB, MiB, human_bytes, human_count


def make_console():
    """A console as wide as COLUMNS says, the terminal's own width, or 100 columns when the output is a file: the
    tables below are laid out to fit 100. Piped, a line of text is never wrapped (a pager or grep sees each message
    whole, not cut mid-phrase); tables still fit the width."""
    import sys

    from rich.console import Console

    tty = sys.stdout.isatty()
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else (None if tty else 100)
    return Console(width=width, highlight=False, soft_wrap=not tty)


def _least_width(i: int, name: str, rows: Sequence[Sequence[str]]) -> int:
    """Column `i`'s widest cell, or its header's longest word where that is wider (headers wrap at their spaces)."""
    return max([len(r[i]) for r in rows] + [max(map(len, name.split()), default=0)])


def add_columns(table, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> None:
    """Columns that shrink by kind when the console is narrow, never by cutting a number: "number" (right-aligned,
    as wide as its widest cell), "name" (left, as wide as its widest cell: a layout or run label read whole), "text"
    (left, wraps first). A header wraps at its spaces; no column is narrower than its longest header word."""
    for i, (name, kind) in enumerate(columns):
        table.add_column(name, justify="right" if kind == "number" else "left",
                         min_width=_least_width(i, name, rows) if kind in ("number", "name") else None)


def bar_width(console, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], most: int = 24) -> int:
    """How many cells a bar column may take beside `columns` (laid out by add_columns) on this console: what is left
    once every other column has its cells and the borders (3 a column, 4 more) theirs, at most `most`; 0 leaves the
    bar out."""
    needed = sum(_least_width(i, name, rows) + 3 for i, (name, _) in enumerate(columns)) + 4
    room = min(most, console.width - needed)
    return room if room >= 4 else 0


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def safe(text: str) -> str:
    """The user's text (names, paths, overrides) for a rich console: printed as text, never read as rich markup,
    its control characters shown as escapes (launch.errors.printable)."""
    from rich.markup import escape

    return escape(printable(text))


def render(resolved: Resolved, plan: Plan, cmd: launcher.LaunchCommand, console,
           per_node: Sequence[launcher.NodeCommand] = ()) -> None:
    r = resolved.recipe
    _recipe_lines(resolved, console)
    _memory_table(plan, r.plan.headroom, console)
    _comm_table(plan, console)
    s = plan.step
    console.print(f"predicted step ({timing_label(plan, resolved)}): {step_parts(plan)}; "
                  f"{s.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {s.mfu:.1%}")
    if mfu_terms(plan):
        for line in _mfu_lines(plan):
            console.print(line)
    formula = FLOPS_SHORT[flops_formula(adapters.adapted(r.peft))]
    console.print(f"  model FLOPs/step {s.model_flops_per_step:.3e} ({formula}); {safe(s.assumptions)}")
    for n in plan.notes:
        console.print(f"  note: {safe(n)}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if r.run.mode == "commbench":
        refusal = " (run.mode=commbench measures collectives only: no fit check)"
    elif plan.fits or r.plan.ignore_fit:
        refusal = ""
    else:
        refusal = " — a real run is refused; lower memory (zero_stage, tp, activation_checkpointing) or set plan.ignore_fit=true"
    console.print(f"[bold]plan: {verdict}[/bold]{refusal}")
    console.print()
    if r.run.launcher == "deepspeed" and per_node:
        console.print("[bold]launch command[/bold] (on the first host; DeepSpeed's runner starts each node over pdsh/ssh)")
        console.print(printable(cmd.shell()), markup=False, soft_wrap=True)
        console.print("[bold]per node[/bold] (what the runner starts there; the environment reaches it through "
                      "DS_ENV_FILE)")
    elif per_node:
        console.print("[bold]launch command per node[/bold] (start each on its node; nodes > 0 join node 0's run directory)")
    else:
        console.print("[bold]launch command[/bold]")
        console.print(printable(cmd.shell()), markup=False, soft_wrap=True)
    for line in node_lines(per_node):
        console.print(line, markup=False, soft_wrap=True)


def _recipe_lines(resolved: Resolved, console) -> None:
    """What was resolved: the recipe, its chain and overrides, the layout, batch and hardware, the rank grid."""
    r = resolved.recipe
    # Names, paths and overrides are the user's text: printed as text, never read as rich markup.
    console.print(f"[bold]recipe[/bold] {safe(resolved.recipe_name)}  ({safe(resolved.recipe_path)})")
    console.print(f"  chain: {safe(' -> '.join(resolved.chain))}")
    if resolved.overrides:
        console.print(f"  overrides: {safe(' '.join(resolved.overrides))}")
    pc = resolved.model.param_counts()
    console.print(f"  backend={r.backend}  model={safe(resolved.model.name)} ({human_count(pc.total)} params)  "
                  f"dtype={r.precision.dtype}  zero_stage={r.parallel.zero_stage}  sp={str(r.parallel.sp).lower()}  "
                  f"activation_checkpointing={r.train.activation_checkpointing}")
    console.print(f"  batch: micro_batch_size={r.batch.micro_batch_size} × grad_accum={resolved.grad_accum} × "
                  f"dp={r.parallel.dp} = global_batch_size={r.batch.global_batch_size}, seq_len={r.batch.seq_len} "
                  f"({resolved.tokens_per_step} tokens/step)")
    console.print(f"  hardware: {safe(resolved.hardware.name)} ({safe(resolved.hardware.device)}), "
                  f"{r.hardware.nodes} node(s) × {r.hardware.gpus_per_node}")
    if resolved.ds_base:
        console.print(f"  deepspeed base: {safe(resolved.ds_base)}")
    for w in resolved.warnings:
        console.print(f"[yellow]warning:[/yellow] {safe(w)}")
    console.print()
    for line in resolved.grid.describe():
        console.print(line)
    if r.parallel.pp > 1:
        for stage in range(r.parallel.pp):
            chunks = chunk_layers(resolved.model.num_layers, r.parallel.pp, r.parallel.vpp, stage)
            console.print(f"  pp stage {stage}: " + ", ".join(f"chunk {v} layers {c[0]}-{c[-1]}" for v, c in enumerate(chunks)))
    console.print()


def _memory_table(plan: Plan, headroom: float, console) -> None:
    """Memory per rank type in the backend's own accounting, the other accountings' totals for reference."""
    from rich import box
    from rich.table import Table

    unit, per = table_unit(max(rp.memory[rp.implementation].total for rp in plan.ranks))
    t = Table(title=f"memory per rank ({unit}, {plan.worst().implementation} accounting)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    t.add_column("ranks")
    for col in ("weights", "grads", "optim", "acts", "buffers", "allow", "total", "host"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("fits")
    for rp in plan.ranks:
        mem = rp.memory[rp.implementation]
        t.add_row(f"{rp.kind} {ranks_text(rp.ranks)}", *(f"{b / per:.3g}" for b in (
            mem.weights, mem.grads, mem.optimizer, mem.activations, mem.buffers, mem.allowance, mem.total,
            mem.host_bytes)), "yes" if mem.total <= rp.usable_bytes else "NO")
    console.print(t)
    worst = plan.worst()
    mem = worst.memory[worst.implementation]
    if mem.phases:
        each = ", ".join(f"{phase} {human_bytes(n)}" for phase, n in mem.phases.items())
        console.print(f"  the step's peak is its {mem.peak_phase}: the kinds are what a rank holds then; each phase's "
                      f"peak before the allowance: {each}", soft_wrap=True)
    others = ", ".join(f"{acc} {human_bytes(m.total)}" for acc, m in worst.memory.items() if acc != worst.implementation)
    console.print(f"  accounting: {worst.implementation} * is the fit check's (the backend's own); for reference "
                  f"{others}; usable device memory {human_bytes(worst.usable_bytes)} of "
                  f"{human_bytes(worst.device_memory_bytes)} (headroom {headroom:.0%})")


def _comm_table(plan: Plan, console) -> None:
    """The collectives of one step, per rank."""
    from rich import box
    from rich.table import Table

    c = Table(title="communication per step (per rank)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for col in ("par", "collective", "link", "group", "calls", "message", "sent/rank", "busbw GB/s", "time ms"):
        c.add_column(col, justify="right" if col not in ("par", "collective", "link") else "left", no_wrap=True)
    for item in plan.comm:
        c.add_row(item.parallelism, item.collective, item.link, str(item.group_size), str(item.calls_per_step),
                  human_bytes(item.message_bytes), human_bytes(item.bytes_per_rank), f"{item.busbw_GBps:.3g}", f"{item.time_s * 1e3:.2f}")
    if not plan.comm:
        c.add_row("-", "none (one rank per group)", "", "", "", "", "", "", "")
    console.print(c)


def table_unit(largest: float) -> tuple[str, int]:
    """The one binary unit a table of sizes up to `largest` bytes is shown in (named in its title)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if largest >= size:
            return unit, size
    return "B", 1


def step_parts(plan: Plan) -> str:
    """The predicted step as the sum of its parts, in ms (the dry run's line and each recipe's README)."""
    s = plan.step
    return (f"{s.total_s * 1e3:.1f} ms = compute {s.compute_s * 1e3:.1f} + bubble {s.bubble_s * 1e3:.1f} + tp/sp "
            f"{s.tp_comm_s * 1e3:.1f} + pp {s.pp_comm_s * 1e3:.1f} + exposed dp {s.dp_exposed_s * 1e3:.1f} (of "
            f"{s.dp_comm_s * 1e3:.1f}) + offload {s.offload_s * 1e3:.1f}"
            + (f" + ZeRO-3 hooks {s.engine_s * 1e3:.1f} (exposed on the host)" if s.engine_s else ""))


def mfu_terms(plan: Plan) -> list[str]:
    """Why the MFU is what it is: the step's share of each kind, the GEMMs' rate beside theirs (none when measured)."""
    s = plan.step
    return [f"{name} {share:.0%}" + (f" (at {s.gemm_peak_share:.0%} of peak)" if name == "GEMMs" else "")
            for name, share in s.terms().items() if share >= 0.005]


def _mfu_lines(plan: Plan, width: int = 96) -> list[str]:
    """The dry run's lines for mfu_terms, each within `width` columns."""
    lines = [f"  MFU {plan.step.mfu:.1%}, what sets it (shares of the step):"]
    for part in mfu_terms(plan):
        if len(lines[-1]) + len(part) + 3 > width:
            lines.append("   ")
        lines[-1] += f" {part} ·"
    return [line.rstrip(" ·") for line in lines]


def timing_label(plan: Plan, resolved: Resolved) -> str:
    """Beside every predicted time: where its figures come from; for a nominal profile what runs measured against
    them, and on CPU ranks how long measuring this machine takes."""
    if plan.step.timing == "calibrated":
        return "calibrated"
    if plan.step.timing == "fitted":
        return ("fitted: the compute model on this machine's calibrated figures; its measured passes do not cover this "
                "layout (the plan's notes say why)")
    hw = resolved.hardware
    label = f"nominal: the {plan.hardware} profile's figures, not measured here" + (
        f"; {hw.nominal_measured}" if hw.nominal_measured else "")
    if hw.device_type != "cpu":
        return label
    installed = sum(not t.missing_packages() for t in BACKENDS.values())  # what calibrate times by default
    calibrate = cal.expected_s(resolved.world_size, resolved.recipe.hardware.gpus_per_node, installed)
    return label + f"; `python -m launch calibrate` (about {calibrate / 60:.0f} min) measures this machine"


def summary(resolved: Resolved, plan: Plan, cmd: launcher.LaunchCommand, run_dir: str, console) -> None:
    """What a run prints before it trains, at most 15 lines: the whole plan is in plan.json and `--dry-run`."""
    r, p = resolved.recipe, resolved.recipe.parallel
    worst = plan.worst()
    mem = worst.memory[worst.implementation]
    s = plan.step
    console.print(f"[bold]{safe(resolved.recipe_name)}[/bold]"
                  + (f"  {safe(' '.join(resolved.overrides))}" if resolved.overrides else ""))
    console.print(f"  {r.backend} · {safe(resolved.model.name)} ({human_count(resolved.model.param_counts().total)} "
                  f"params) · {r.precision.dtype} · tp {p.tp} × pp {p.pp} × dp {p.dp}"
                  + (" + sp" if p.sp else "") + f" · ZeRO-{p.zero_stage} · checkpointing "
                  f"{r.train.activation_checkpointing}")
    console.print(f"  {r.batch.global_batch_size} sequences × {r.batch.seq_len} tokens per step "
                  f"(micro-batch {r.batch.micro_batch_size} × {resolved.grad_accum} accumulated × dp {p.dp}), "
                  f"{r.train.steps} steps on {safe(resolved.hardware.name)}, {r.hardware.nodes} node(s) × "
                  f"{r.hardware.gpus_per_node}")
    for w in resolved.warnings:
        console.print(f"[yellow]warning:[/yellow] {safe(w)}")
    console.print(f"  memory per rank {human_bytes(mem.total)} of {human_bytes(worst.usable_bytes)} usable "
                  f"({worst.implementation} accounting): {'fits' if plan.fits else 'DOES NOT FIT'}")
    console.print(f"  predicted step {s.total_s * 1e3:.1f} ms, {s.tokens_per_s_per_device:,.0f} tokens/s/device, MFU "
                  f"{s.mfu:.1%} ({safe(timing_label(plan, resolved))})")
    console.print(f"  run directory {safe(run_dir)}  (plan.json: the whole plan; launch_cmd.txt: the command)")


def node_lines(per_node: Sequence[launcher.NodeCommand]) -> list[str]:
    """One line per node listed (launch.config.grid.shown_nodes), each naming its node rank, and a count of the rest."""
    lines = []
    for i, nc in enumerate(per_node):
        if i and nc.node_rank != per_node[i - 1].node_rank + 1:
            lines.append(f"  ... nodes {per_node[i - 1].node_rank + 1}-{nc.node_rank - 1}: the same with their own "
                         "node rank")
        host = f" ({nc.host})" if nc.host else ""
        lines.append(printable(f"  node {nc.node_rank}{host}: {nc.command.shell()}"))
    return lines


def ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def layouts_table(rows, title: str, console) -> None:
    """`python -m launch plan`'s rows (commands.plan.Row) as one table, in the figure's order, the best marked."""
    from rich import box
    from rich.table import Table

    from launch.commands.plan_figure import ordered

    rows, best = ordered(rows)
    unit, per = table_unit(max(r.plan.worst().memory[r.plan.worst().implementation].total for r in rows))
    # each line made safe on its own: safe() writes a line break as the two characters \n
    heading = "\n".join(safe(line) for line in title.split("\n"))
    t = Table(title=f"{heading}\n(memory per GPU in {unit}; fits: best = the fastest that fits at its GPU count)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for col in ("GPUs", "layout", "states", "acts", "total", "fits", "step ms", "tok/s/GPU", "timing"):
        t.add_column(col, justify="left" if col in ("layout", "timing") else "right", no_wrap=True)
    for r in rows:
        w = r.plan.worst()
        mem = w.memory[w.implementation]
        fits = "best" if id(r) in best else "yes" if r.plan.fits else "[red]no[/red]"
        t.add_row(str(r.world_size), safe(r.label), f"{mem.model_states / per:.3g}", f"{mem.activations / per:.3g}",
                  f"{mem.total / per:.3g}", fits, f"{r.plan.step.total_s * 1e3:,.0f}",
                  f"{r.plan.step.tokens_per_s_per_device:,.0f}", r.plan.step.timing)
    console.print(t)


def recommendation(recipe_name: str, rec, shown: int, console) -> None:
    """What `recommend` found (plan.search.Recommendation): the ranked layouts that fit, what was dropped and why."""
    from rich.markup import escape
    from rich.table import Table

    fit = rec.ranked
    refused = sum(n for why, n in rec.dropped if why != "does not fit" and not why.startswith("not ranked"))
    too_big = dict(rec.dropped).get("does not fit", 0)
    console.print(f"[bold]recommend[/bold] {escape(recipe_name)}: {rec.tried} layouts tried, {rec.fitting} fit "
                  f"({len(fit)} ranked), {too_big} do not fit, {refused} cannot be built")
    if not fit:
        console.print("no layout fits" + (f"; the closest is {escape(rec.closest.label)}: {escape(rec.closest.refused)}"
                                          if rec.closest else ""))
        return
    t = Table(title="layouts that fit, fastest first (predicted)", title_justify="left")
    columns = [("#", "number"), ("layout", "name"), ("step ms", "number"), ("tokens/s /device", "number"),
               ("memory /rank GiB", "number"), ("comm ms", "number"), ("timing", "name")]
    rows = []
    for i, c in enumerate(fit[:shown], 1):
        s, worst = c.plan.step, c.plan.worst()
        rows.append([str(i), escape(c.label), f"{s.total_s * 1e3:.1f}", f"{s.tokens_per_s_per_device:,.0f}",
                     f"{worst.memory[worst.implementation].total / GiB:.2f}",
                     f"{sum(x.time_s for x in c.plan.comm) * 1e3:.1f}", s.timing])
    add_columns(t, columns, rows)
    bar = bar_width(console, columns, rows)  # tokens/s/device against the fastest, where the console has room
    if bar:
        t.add_column("", no_wrap=True)
    best = fit[0].plan.step.tokens_per_s_per_device
    for row, c in zip(rows, fit, strict=False):
        t.add_row(*row, *(["█" * max(1, round(bar * c.plan.step.tokens_per_s_per_device / best))] if bar else []))
    console.print(t)
    if len(fit) > shown:
        console.print(f"  … and {len(fit) - shown} more that fit (top={len(fit)} lists them all)")
    for why, n in rec.dropped:
        console.print(f"  dropped {n}: {escape(why)}")
    for n in sorted({n for c in fit[:shown] for n in c.plan.notes if n.startswith("time:")}):
        console.print(f"  note: {escape(n)}")


def sweep_table(rows: Sequence[dict], title: str, console) -> None:
    """A sweep's members as commands.sweep.plan_rows computes them (predicted figures)."""
    from rich.table import Table

    t = Table(title=safe(title), title_justify="left")
    # predicted, per rank: memory of the worst rank, step and communication time, tokens/s per device
    for col in ("run", "fits", "memory GiB", "step ms", "comm ms", "tokens/s/dev", "timing"):
        t.add_column(col, justify="left" if col in ("run", "timing") else "right", no_wrap=col == "run")
    for r in rows:
        t.add_row(safe(r["label"]), "yes" if r["fits"] else "NO", f"{r['memory_GiB']:.2f}", f"{r['step_ms']:.1f}",
                  f"{r['comm_ms']:.1f}", f"{r['tokens_per_s_per_device']:,.0f}", r["timing"])
    console.print(t)
