"""How a plan and a launch command look on the console: the plan tables, the node lines, units and the escaping
of the user's own text. Computing lives in launch/plan; this module only shows."""
from __future__ import annotations

import os
from typing import Sequence

from launch.config.resolve import Resolved
from launch.errors import printable
from launch.plan.layout import Plan
from launch.plan.memory import chunk_layers
from launch.run import launcher
from launch.units import GiB, KiB, MiB


def make_console():
    from rich.console import Console

    return Console(width=int(os.environ.get("COLUMNS", "120")), highlight=False, soft_wrap=True)


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def safe(text: str) -> str:
    """The user's text (names, paths, overrides) for a rich console: printed as text, never read as rich markup,
    its control characters shown as escapes (launch.errors.printable)."""
    from rich.markup import escape

    return escape(printable(text))


def render(resolved: Resolved, plan: Plan, cmd: launcher.LaunchCommand, console,
           per_node: Sequence[launcher.NodeCommand] = ()) -> None:
    from rich.table import Table

    r = resolved.recipe
    # Names, paths and overrides are the user's text: printed as text, never read as rich markup.
    console.print(f"[bold]recipe[/bold] {safe(resolved.recipe_name)}  ({safe(resolved.recipe_path)})")
    console.print(f"  chain: {safe(' -> '.join(resolved.chain))}")
    if resolved.overrides:
        console.print(f"  overrides: {safe(' '.join(resolved.overrides))}")
    pc = resolved.model.param_counts()
    console.print(f"  backend={r.backend}  model={safe(resolved.model.name)} ({pc.total / 1e9:.3f}B params)  "
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

    t = Table(title="memory per rank (GiB)", title_justify="left")
    t.add_column("ranks")
    t.add_column("accounting")
    for col in ("weights", "grads", "optimizer", "activations", "buffers", "allowance", "total", "host"):
        t.add_column(col, justify="right")
    t.add_column("fits")
    for rp in plan.ranks:
        for acc, mem in rp.memory.items():
            mark = acc + (" *" if acc == rp.implementation else "")
            fits = ("yes" if mem.total <= rp.usable_bytes else "NO") if acc == rp.implementation else ""
            t.add_row(f"{rp.kind} {ranks_text(rp.ranks)}", mark, gib(mem.weights), gib(mem.grads), gib(mem.optimizer),
                      gib(mem.activations), gib(mem.buffers), gib(mem.allowance), gib(mem.total),
                      gib(mem.host_bytes), fits)
    console.print(t)
    worst = plan.worst()
    console.print(f"  * = accounting used by the fit check; usable device memory {gib(worst.usable_bytes)} GiB of "
                  f"{gib(worst.device_memory_bytes)} (headroom {r.plan.headroom:.0%})")

    c = Table(title="communication per step (per rank)", title_justify="left")
    for col in ("parallelism", "collective", "link", "group", "calls", "message", "sent/rank", "busbw GB/s", "time ms"):
        c.add_column(col, justify="right" if col not in ("parallelism", "collective", "link") else "left")
    for item in plan.comm:
        c.add_row(item.parallelism, item.collective, item.link, str(item.group_size), str(item.calls_per_step),
                  size(item.message_bytes), size(item.bytes_per_rank), f"{item.busbw_GBps:.3g}", f"{item.time_s * 1e3:.2f}")
    if not plan.comm:
        c.add_row("-", "none (one rank per group)", "", "", "", "", "", "", "")
    console.print(c)
    s = plan.step
    console.print(f"predicted step: {s.total_s * 1e3:.1f} ms = compute {s.compute_s * 1e3:.1f} + bubble "
                  f"{s.bubble_s * 1e3:.1f} + tp/sp {s.tp_comm_s * 1e3:.1f} + pp {s.pp_comm_s * 1e3:.1f} + exposed dp "
                  f"{s.dp_exposed_s * 1e3:.1f} (of {s.dp_comm_s * 1e3:.1f}) + offload {s.offload_s * 1e3:.1f}; "
                  f"{s.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {s.mfu:.1%}")
    console.print(f"  model FLOPs/step {s.model_flops_per_step:.3e} (6·N + 12·L·h·s per token, torchtitan); {safe(s.assumptions)}")
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
        console.print(printable(cmd.shell()), markup=False)
        console.print("[bold]per node[/bold] (what the runner starts there; the environment reaches it through "
                      "DS_ENV_FILE)")
    elif per_node:
        console.print("[bold]launch command per node[/bold] (start each on its node; nodes > 0 join node 0's run directory)")
    else:
        console.print("[bold]launch command[/bold]")
        console.print(printable(cmd.shell()), markup=False)
    for line in node_lines(per_node):
        console.print(line, markup=False)


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


def size(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def layouts_table(rows, title: str, console) -> None:
    """`python -m launch plan`'s rows (commands.plan.Row) as one table."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("GPUs", "layout", "states GiB", "acts GiB", "total GiB", "fits", "step ms", "tok/s/GPU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        w = r.plan.worst()
        mem = w.memory[w.implementation]
        t.add_row(str(r.world_size), r.label, f"{mem.model_states / GiB:.1f}", f"{mem.activations / GiB:.1f}",
                  f"{mem.total / GiB:.1f}", "yes" if r.plan.fits else "[red]no[/red]",
                  f"{r.plan.step.total_s * 1e3:.0f}", f"{r.plan.step.tokens_per_s_per_device:,.0f}")
    console.print(t)
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
    for col in ("#", "layout", "step ms", "tokens/s/device", "memory/rank GiB", "comm ms", "timing", ""):
        t.add_column(col, justify="right" if col in ("#", "step ms", "tokens/s/device", "memory/rank GiB", "comm ms")
                     else "left", no_wrap=col in ("layout", ""))
    best = fit[0].plan.step.tokens_per_s_per_device
    for i, c in enumerate(fit[:shown], 1):
        s, worst = c.plan.step, c.plan.worst()
        bar = "█" * max(1, round(24 * s.tokens_per_s_per_device / best))
        t.add_row(str(i), escape(c.label), f"{s.total_s * 1e3:.1f}", f"{s.tokens_per_s_per_device:,.0f}",
                  f"{worst.memory[worst.implementation].total / GiB:.2f}", f"{sum(x.time_s for x in c.plan.comm) * 1e3:.1f}",
                  s.timing, bar)
    console.print(t)
    if len(fit) > shown:
        console.print(f"  … and {len(fit) - shown} more that fit (top={len(fit)} lists them all)")
    for why, n in rec.dropped:
        console.print(f"  dropped {n}: {escape(why)}")
    for n in sorted({n for c in fit[:shown] for n in c.plan.notes if n.startswith("time:")}):
        console.print(f"  note: {escape(n)}")


def sweep_table(rows: Sequence[dict], title: str, console) -> None:
    """A sweep's members as commands.sweep.plan_rows computes them."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("run", "fits", "memory/rank GiB", "predicted step ms", "predicted comm ms", "tokens/s/device", "timing"):
        t.add_column(col, justify="left" if col in ("run", "timing") else "right")
    for r in rows:
        t.add_row(r["label"], "yes" if r["fits"] else "NO", f"{r['memory_GiB']:.2f}", f"{r['step_ms']:.1f}",
                  f"{r['comm_ms']:.1f}", f"{r['tokens_per_s_per_device']:,.0f}", r["timing"])
    console.print(t)
