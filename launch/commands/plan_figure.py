"""The figure of `python -m launch plan`: memory per GPU of every layout as stacked bars against device memory,
as a PNG and as one self-contained HTML page. Drawing only: the plans come computed (launch/commands/plan.py)."""
from __future__ import annotations

import base64
import html
import io

from launch.units import GiB


def chart_png(rows, title: str) -> bytes:
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


def render_html(rows, png: bytes, title: str) -> str:
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
