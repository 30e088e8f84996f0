"""The figure of `python -m launch plan`: memory per GPU of every layout as stacked bars against device memory, as a
PNG (its page is launch/commands/plan_page.py); and how plan's three files are told apart from anyone else's. Drawing
only: the plans come computed (launch/commands/plan.py)."""
from __future__ import annotations

import io
from pathlib import Path

from launch import inputs
from launch.units import GiB

GENERATOR = "layoutlab plan"  # how the page, the PNG and the JSON of `python -m launch plan` say they are ours
HTML_HEAD = f'<!doctype html><html><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">'
PLAN_ROW_KEYS = {"model", "world_size", "layout", "plan"}
# A JSON row before plan took several models: still ours, so that plan replaces the file an older version wrote.
PLAN_ROW_KEYS_ONE_MODEL = {"world_size", "layout", "plan"}
# The parts of a rank's memory (launch.plan.layout.Memory) a bar stacks, in order, and their colours (PNG and page).
PART_COLOURS = {"weights": "#4c72b0", "grads": "#55a868", "optimizer": "#8172b2", "activations": "#ccb974",
                "buffers": "#64b5cd", "allowance": "#b0b0b0"}


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
    rows = inputs.load_json(path)
    # non-empty: a plan always lists a layout, and `[]` is anyone's
    return isinstance(rows, list) and bool(rows) and all(
        isinstance(r, dict) and set(r) in (PLAN_ROW_KEYS, PLAN_ROW_KEYS_ONE_MODEL) for r in rows)


def ordered(rows):
    """Per model (in the order the rows name them) and world size, the layouts that fit fastest first, then those
    that do not fit, smallest memory first; with the fastest that fits of each model and world size (marked best)."""
    models = {m: i for i, m in enumerate(dict.fromkeys(r.model for r in rows))}

    def key(r):
        mem = r.plan.worst().memory[r.plan.worst().implementation].total
        return (models[r.model], r.world_size, not r.plan.fits,
                -r.plan.step.tokens_per_s_per_device if r.plan.fits else mem)

    out = sorted(rows, key=key)
    best = {}  # the first that fits of each (model, world size): the fastest, as sorted
    for r in out:
        if r.plan.fits:
            best.setdefault((r.model, r.world_size), id(r))
    return out, set(best.values())


def chart_png(rows, title: str) -> bytes:
    """One horizontal bar per layout (memory of its worst rank, stacked by kind) against the device's memory and the
    usable line below it; 1,400 pixels wide, as tall as the layouts need."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, best = ordered(rows)
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.32 * len(rows)), dpi=100)
    y = list(range(len(rows)))[::-1]  # the first row at the top
    lefts = [0.0] * len(rows)
    for part, colour in PART_COLOURS.items():
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
