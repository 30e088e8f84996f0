"""`python -m launch plan model=llama-2-7b world_size=4,8 hardware=h100-sxm [out=plans/NAME] ...`

Compares layouts of one model on a GPU count (the seed's "7B on 4 GPUs, then raise the GPU count"):
every t × d × ZeRO stage (× activation checkpointing) that the model's shape admits, stacked memory bars per layout
against the device-memory line, green where the plan fits and red where it does not. Writes a PNG
and a self-contained HTML page (the PNG inlined) next to a JSON of the numbers.
"""
from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from launch.config.backends import traits
from launch.config.grid import RankGrid
from launch.config.hardware import load_profile
from launch.config.models import load_model
from launch.errors import ConfigError
from launch.plan.build import make_plan
from launch.plan.layout import Layout, Plan
from launch.run import envinfo
from launch.units import GiB

OPTIONS = {
    "model": "catalogue model name (default llama-2-7b)",
    "world_size": "GPU counts (world sizes), comma separated (default 4)",
    "hardware": "hardware profile (default h100-sxm)",
    "gpus_per_node": "devices per node (default 8, or the GPU count when smaller)",
    "backend": "deepspeed | megatron (default deepspeed; megatron adds sequence parallel)",
    "dtype": "bf16 | fp16 | fp32 (default bf16)",
    "seq_len": "tokens per sequence (default 4096)",
    "micro_batch_size": "default 1",
    "global_batch_size": "default 8 × the largest GPU count",
    "activation_checkpointing": "policies to compare, comma separated (default none,full)",
    "out": "output path without suffix (default plans/<model>_<hardware>)",
}


@dataclass(frozen=True)
class Row:
    world_size: int
    label: str
    plan: Plan
    layout: Layout


def _parse(args: Sequence[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    for a in args:
        if "=" not in a:
            raise ConfigError("command line", a, a, "is not key=value",
                              f"plan takes key=value options: {', '.join(OPTIONS)}")
        k, v = a.split("=", 1)
        if k not in OPTIONS:
            raise ConfigError("command line", k, v, "is not a plan option", f"use one of: {', '.join(OPTIONS)}")
        opts[k] = v
    return opts


def _int(opts: dict[str, str], key: str, default: int) -> int:
    raw = opts.get(key, str(default))
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError("command line", key, raw, "is not an integer", f"set {key}=<integer>") from None
    if v < 1:
        raise ConfigError("command line", key, v, "must be at least 1", f"set {key}=1 or more")
    return v


def layouts(opts: dict[str, str]) -> list[Row]:
    model = load_model(name=opts.get("model", "llama-2-7b"), context="command line")
    hw = load_profile(opts.get("hardware", "h100-sxm"), context="command line", field="hardware")
    try:
        gpu_counts = [int(g) for g in opts.get("world_size", "4").split(",")]
    except ValueError:
        raise ConfigError("command line", "world_size", opts["world_size"], "is not a list of integers", "write e.g. world_size=4,8") from None
    if not gpu_counts or any(not 1 <= g <= 1_000_000 for g in gpu_counts):
        raise ConfigError("command line", "world_size", opts.get("world_size", "4"), "needs GPU counts from 1 to 1,000,000",
                          "write e.g. world_size=4,8")
    backend = opts.get("backend", "deepspeed")
    bt = traits(backend, where="command line")
    dtype = opts.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ConfigError("command line", "dtype", dtype, "is not a dtype", "use bf16, fp16 or fp32")
    if not hw.supports(dtype):
        raise ConfigError("command line", "dtype", dtype, f"is not supported by {hw.device}",
                          f"use dtype={'fp16' if hw.supports('fp16') else 'fp32'}")
    policies = opts.get("activation_checkpointing", "none,full").split(",")
    for rc in policies:
        if rc not in ("none", "selective", "full"):
            raise ConfigError("command line", "activation_checkpointing", rc, "is not a checkpointing policy",
                              "use none, selective or full")
    seq = _int(opts, "seq_len", 4096)
    micro = _int(opts, "micro_batch_size", 1)
    gbs = _int(opts, "global_batch_size", 8 * max(gpu_counts))
    machine = envinfo.machine()
    rows: list[Row] = []
    for gpus in gpu_counts:
        gpn = _int(opts, "gpus_per_node", min(8, gpus))
        if gpus % gpn:
            raise ConfigError("command line", "world_size", gpus, f"is not a multiple of gpus_per_node={gpn}",
                              "choose world sizes of whole nodes")
        for tp in [t for t in (1, 2, 4, 8) if t <= min(gpus, gpn) and gpus % t == 0
                   and model.num_kv_heads % t == 0 and model.intermediate_size % t == 0]:
            dp = gpus // tp
            if gbs % (micro * dp):
                continue
            stages = (0,) if dp == 1 else (0, 1, 2, 3)
            for z in stages:
                sp = "sp" in bt.features and tp > 1 and z in bt.sp_zero_stages
                for rc in policies:
                    lay = Layout(backend=backend, model=model, hardware=hw, grid=RankGrid(tp, 1, dp, gpn, gpus // gpn),
                                 zero_stage=z, dtype=dtype, micro_batch_size=micro, global_batch_size=gbs, seq_len=seq,
                                 activation_checkpointing=rc, sp=sp,
                                 ds_zero=_ds_zero(z))
                    name = ("DP" if z == 0 and tp == 1 else f"ZeRO-{z}" if tp == 1 else
                            f"TP{tp}" if dp == 1 else f"TP{tp}×" + ("DP" if z == 0 else f"ZeRO-{z}") + f" (dp{dp})")
                    if rc != "none":
                        name += f" +AC({rc})"
                    rows.append(Row(gpus, name, make_plan(lay, name, machine), lay))
    return rows


def _ds_zero(stage: int) -> dict:
    from launch.config.dsconfig import default_base, read_json

    return read_json(default_base(stage, "none", "none"), context="ds_configs", field="zero").get("zero_optimization", {})


def chart_png(rows: list[Row], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ("weights", "grads", "optimizer", "activations", "buffers", "allowance")
    colours = ("#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#b0b0b0")
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows) + 2), 6))
    x = range(len(rows))
    bottoms = [0.0] * len(rows)
    for part, colour in zip(parts, colours):
        vals = [getattr(r.plan.worst().memory[r.plan.worst().implementation], part) / GiB for r in rows]
        ax.bar(x, vals, bottom=bottoms, color=colour, label=part, width=0.7)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, r in enumerate(rows):
        ok = r.plan.fits
        ax.bar(i, bottoms[i], fill=False, edgecolor="#2ca02c" if ok else "#d62728", linewidth=2.5, width=0.7)
        ax.text(i, bottoms[i], "fits" if ok else "OOM", ha="center", va="bottom", fontsize=8,
                color="#2ca02c" if ok else "#d62728")
    mem = rows[0].layout.hardware.memory_bytes / GiB
    ax.axhline(mem, color="black", linestyle="--", linewidth=1.2, label=f"device memory {mem:.0f} GiB")
    usable = rows[0].plan.ranks[0].usable_bytes / GiB
    ax.axhline(usable, color="grey", linestyle=":", linewidth=1, label=f"usable (headroom) {usable:.0f} GiB")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r.label}\n{r.world_size} GPUs" for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU (worst rank)")
    ax.set_ylim(0, max(max(bottoms), mem) * 1.12)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def render_html(rows: list[Row], png: bytes, title: str) -> str:
    b64 = base64.b64encode(png).decode()
    body = []
    for r in rows:
        w = r.plan.worst()
        mem = w.memory[w.implementation]
        body.append(
            f"<tr class='{'ok' if r.plan.fits else 'oom'}'><td>{r.world_size}</td><td>{html.escape(r.label)}</td>"
            f"<td>{mem.model_states / GiB:.1f}</td><td>{mem.activations / GiB:.1f}</td><td>{mem.total / GiB:.1f}</td>"
            f"<td>{'yes' if r.plan.fits else 'no'}</td><td>{r.plan.step.total_s * 1e3:.0f}</td>"
            f"<td>{r.plan.step.tokens_per_s_per_device:,.0f}</td><td>{r.plan.step.mfu:.1%}</td></tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
tr.ok td:nth-child(6){{color:#2ca02c}}tr.oom td:nth-child(6){{color:#d62728;font-weight:bold}}</style></head><body>
<h1>{html.escape(title)}</h1>
<img alt="memory per GPU by layout" src="data:image/png;base64,{b64}">
<table><tr><th>GPUs</th><th>layout</th><th>model states GiB</th><th>activations GiB</th><th>total GiB</th><th>fits</th>
<th>pred. step ms</th><th>tokens/s/GPU</th><th>pred. MFU</th></tr>{''.join(body)}</table>
<p>{html.escape(' · '.join(rows[0].plan.notes))}</p></body></html>
"""


def cmd_plan(args: Sequence[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    opts = _parse(args)
    rows = layouts(opts)
    if not rows:
        raise ConfigError("command line", "global_batch_size", opts.get("global_batch_size"),
                          "admits no layout (it must divide by micro_batch_size × dp)", "choose a multiple of the GPU count")
    first = rows[0].layout
    title = (f"{first.model.name} on {first.hardware.name}: memory per GPU by layout\n"
             f"(seq {first.seq_len}, micro-batch {first.micro_batch_size}, {first.dtype}, {first.backend})")
    out = Path(opts.get("out", f"plans/{first.model.name}_{first.hardware.name}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    png = chart_png(rows, title)
    out.with_suffix(".png").write_bytes(png)
    out.with_suffix(".html").write_text(render_html(rows, png, title))
    out.with_suffix(".json").write_text(json.dumps(
        [{"world_size": r.world_size, "layout": r.label, "plan": json.loads(r.plan.to_json())} for r in rows], indent=1))
    t = Table(title=title, title_justify="left")
    for col in ("GPUs", "layout", "states GiB", "acts GiB", "total GiB", "fits", "step ms", "tok/s/GPU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        w = r.plan.worst()
        mem = w.memory[w.implementation]
        t.add_row(str(r.world_size), r.label, f"{mem.model_states / GiB:.1f}", f"{mem.activations / GiB:.1f}",
                  f"{mem.total / GiB:.1f}", "yes" if r.plan.fits else "[red]no[/red]",
                  f"{r.plan.step.total_s * 1e3:.0f}", f"{r.plan.step.tokens_per_s_per_device:,.0f}")
    console = Console(width=120, highlight=False)
    console.print(t)
    console.print(f"wrote {out.with_suffix('.png')}, {out.with_suffix('.html')}, {out.with_suffix('.json')}")
    return 0
