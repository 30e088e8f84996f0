"""The figure of `python -m launch plan`: memory per GPU of every layout as stacked bars against device memory,
as a PNG and as one self-contained HTML page. Drawing only: the plans come computed (launch/commands/plan.py)."""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from launch.pages import CSP_META
from launch.units import GiB

GENERATOR = "layoutlab plan"  # how the page, the PNG and the JSON of `python -m launch plan` say they are ours
HTML_HEAD = f'<!doctype html><html><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">'
PLAN_ROW_KEYS = {"world_size", "layout", "plan"}


def ours(path: Path) -> bool:
    """Whether the file `path` is one `plan` wrote, recognised by the marks it writes itself (never by a search of
    the text): the PNG's generator text, the HTML page's head, the JSON's row schema."""
    try:
        head = path.read_bytes()[:4096]
    except OSError:
        return False
    if path.suffix == ".png":
        return head.startswith(b"\x89PNG") and GENERATOR.encode() in head
    if path.suffix == ".html":
        return head.startswith(HTML_HEAD.encode())
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    # non-empty: a plan always lists a layout, and `[]` is anyone's
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and set(r) == PLAN_ROW_KEYS for r in rows)


def ordered(rows):
    """Per world size, the layouts that fit fastest first, then those that do not fit, smallest memory first; with
    the fastest that fits of each world size (marked best)."""
    def key(r):
        mem = r.plan.worst().memory[r.plan.worst().implementation].total
        return (r.world_size, not r.plan.fits, -r.plan.step.tokens_per_s_per_device if r.plan.fits else mem)

    out = sorted(rows, key=key)
    best = {id(next(r for r in out if r.world_size == ws and r.plan.fits)) for ws in {r.world_size for r in out}
            if any(r.world_size == ws and r.plan.fits for r in out)}
    return out, best


def chart_png(rows, title: str) -> bytes:
    """One horizontal bar per layout (memory of its worst rank, stacked by kind) against the device's memory and the
    usable line below it; 1,400 pixels wide, as tall as the layouts need."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, best = ordered(rows)
    parts = ("weights", "grads", "optimizer", "activations", "buffers", "allowance")
    colours = ("#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#b0b0b0")
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.32 * len(rows)), dpi=100)
    y = list(range(len(rows)))[::-1]  # the first row at the top
    lefts = [0.0] * len(rows)
    for part, colour in zip(parts, colours, strict=True):
        vals = [getattr(r.plan.worst().memory[r.plan.worst().implementation], part) / GiB for r in rows]
        ax.barh(y, vals, left=lefts, color=colour, label=part, height=0.7)
        lefts = [a + v for a, v in zip(lefts, vals, strict=True)]
    mem = rows[0].layout.hardware.memory_bytes / GiB
    usable = rows[0].plan.ranks[0].usable_bytes / GiB
    for yi, r, total in zip(y, rows, lefts, strict=True):
        s = r.plan.step
        text = (f"{total:.1f} GiB · {s.total_s * 1e3:,.0f} ms · {s.tokens_per_s_per_device:,.0f} tok/s/GPU"
                if r.plan.fits else f"{total:.1f} GiB: does not fit")
        if id(r) in best:
            text = "best · " + text
        ax.text(total + mem * 0.01, yi, text, va="center", fontsize=8,
                color="#1a7f37" if id(r) in best else "black" if r.plan.fits else "#c62828",
                fontweight="bold" if id(r) in best else "normal")
    ax.axvline(mem, color="black", linestyle="-", linewidth=1.2, label=f"device memory {mem:.0f} GiB")
    ax.axvline(usable, color="grey", linestyle="--", linewidth=1,
               label=f"usable: {usable:.0f} GiB (device memory less the plan's headroom)")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{r.label} · {r.world_size} GPUs" for r in rows], fontsize=8)
    ax.set_xlabel("GiB per GPU (the worst rank)")
    ax.set_xlim(0, max(max(lefts), mem) * 1.35)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1.6 + 0.32 * len(rows))), ncol=4, fontsize=8,
              frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": GENERATOR})
    plt.close(fig)
    return buf.getvalue()


def render_html(rows, png: bytes, title: str) -> str:
    b64 = base64.b64encode(png).decode()
    rows, best = ordered(rows)
    body = []
    for r in rows:
        w = r.plan.worst()
        mem = w.memory[w.implementation]
        body.append(
            f"<tr class='{'ok' if r.plan.fits else 'oom'}'><td>{r.world_size}</td>"
            f"<td>{html.escape(r.label)}{' <b>(best)</b>' if id(r) in best else ''}</td>"
            f"<td>{mem.model_states / GiB:.1f}</td><td>{mem.activations / GiB:.1f}</td><td>{mem.total / GiB:.1f}</td>"
            f"<td>{'yes' if r.plan.fits else 'no'}</td><td>{r.plan.step.total_s * 1e3:.0f}</td>"
            f"<td>{r.plan.step.tokens_per_s_per_device:,.0f}</td><td>{r.plan.step.mfu:.1%}</td></tr>")
    return f"""{HTML_HEAD}{CSP_META}<title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
tr.ok td:nth-child(6){{color:#2ca02c}}tr.oom td:nth-child(6){{color:#d62728;font-weight:bold}}</style></head><body>
<h1>{html.escape(title)}</h1>
<img alt="memory per GPU by layout" style="max-width:100%;height:auto" src="data:image/png;base64,{b64}">
<table><tr><th>GPUs</th><th>layout</th><th>model states GiB</th><th>activations GiB</th><th>total GiB</th><th>fits</th>
<th>pred. step ms</th><th>tokens/s/GPU</th><th>pred. MFU</th></tr>{''.join(body)}</table>
<p>{html.escape(' · '.join(rows[0].plan.notes))}</p></body></html>
"""
