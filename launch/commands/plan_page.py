"""The page of `python -m launch plan`: for each (model, GPU count) the planner computed, one pre-rendered panel of
stacked memory bars (the worst rank of each layout) against the device-memory and usable lines, each bar marked fits
or does not fit, with its predicted step time and tokens/s/GPU; two selectors show one panel at a time.

Every number, label, width (a CSS percentage) and colour is computed here and written into the markup. The page's one
script (SCRIPT) does no arithmetic: it un-hides the panel whose data-model and data-gpus are the selected pair, and
reads `#model=NAME&gpus=N` from the address at load, so that a link (or a headless browser) chooses the pair. The
Content-Security-Policy lets that one script run by its hash and nothing else (launch/pages.py). Without script the
first pair's panel shows. Rendering only: the plans come computed (launch/commands/plan.py)."""
from __future__ import annotations

import html
from collections.abc import Sequence

from launch.commands.plan_figure import HTML_HEAD, PART_COLOURS, ordered
from launch.pages import csp_meta_running
from launch.units import GiB

SCRIPT = """
const model = document.getElementById("model"), gpus = document.getElementById("gpus");
const panels = document.querySelectorAll("section[data-model]");
function show() {
  for (const p of panels) p.hidden = !(p.dataset.model === model.value && p.dataset.gpus === gpus.value);
}
function fromAddress() {
  const want = new URLSearchParams(location.hash.slice(1));
  for (const [select, key] of [[model, "model"], [gpus, "gpus"]]) {
    const value = want.get(key);
    if ([...select.options].some(o => o.value === value)) select.value = value;
  }
  show();
}
function toAddress() {
  location.hash = new URLSearchParams({model: model.value, gpus: gpus.value}).toString();
  show();
}
model.addEventListener("change", toAddress);
gpus.addEventListener("change", toAddress);
window.addEventListener("hashchange", fromAddress);
fromAddress();
"""
STYLE = """body{font-family:sans-serif;margin:2em;max-width:110em}
.pick{margin:1em 0;font-size:1.1em}.pick select{font-size:1em;margin:0 1.5em 0 .3em}
.legend i{display:inline-block;width:1em;height:1em;vertical-align:middle;margin:0 .3em 0 1em}
.legend .device,.legend .usable{width:0;height:1.2em;margin-left:1.5em}
.row{display:grid;grid-template-columns:17em 1fr 7.5em 27em;align-items:center;gap:0 .8em;min-height:1.6em}
.track{position:relative;height:1.6em}.stack{display:flex;height:1.1em;margin-top:.25em}.stack i{height:100%}
.line{position:absolute;top:0;bottom:0;width:0}.device{border-left:2px solid #000}.usable{border-left:2px dashed #777}
.verdict{font-weight:bold}.fits .verdict{color:#1a7f37}.oom .verdict{color:#c62828}.oom .label{color:#c62828}
.best .label{color:#1a7f37;font-weight:bold}.figures{font-size:.9em;white-space:nowrap}
.notes{color:#555;font-size:.9em}"""


def _pct(value: float, full: float) -> str:
    return f"{100 * value / full:.3f}%"


def _bar(r, full: float, best: bool) -> str:
    """One layout's row: its name, its stacked bar and the two lines (CSS percentages of `full` bytes), its verdict
    and figures."""
    w = r.plan.worst()
    mem = w.memory[w.implementation]
    s = r.plan.step
    parts = "".join(
        f'<i style="width:{_pct(getattr(mem, part), full)};background:{colour}" '
        f'title="{html.escape(f"{part} {getattr(mem, part) / GiB:.1f} GiB")}"></i>'
        for part, colour in PART_COLOURS.items())
    figures = (f"{mem.total / GiB:.1f} GiB of {w.usable_bytes / GiB:.1f} usable · {s.total_s * 1e3:,.0f} ms · "
               f"{s.tokens_per_s_per_device:,.0f} tok/s/GPU · {s.timing}")
    kind = ("fits best" if best else "fits") if r.plan.fits else "oom"
    return (f'<div class="row {kind}" data-layout="{html.escape(r.label)}" data-fits="{str(r.plan.fits).lower()}">'
            f'<span class="label">{html.escape(r.label)}{" · best" if best else ""}</span>'
            f'<span class="track"><span class="stack">{parts}</span>'
            f'<b class="line device" style="left:{_pct(w.device_memory_bytes, full)}"></b>'
            f'<b class="line usable" style="left:{_pct(w.usable_bytes, full)}"></b></span>'
            f'<span class="verdict">{"fits" if r.plan.fits else "does not fit"}</span>'
            f'<span class="figures">{html.escape(figures)}</span></div>')


def _panel(model: str, gpus: int, rows, best: set[int], full: float, shown: bool, why_none: str) -> str:
    """The panel of one (model, GPU count): its bars in `ordered`'s order, or why it has none."""
    head = f"{model} on {gpus} GPU{'s' if gpus > 1 else ''}"
    if rows:
        w = rows[0].plan.worst()
        fitting = sum(r.plan.fits for r in rows)
        head += (f": {len(rows)} layouts, {fitting} fit · device memory {w.device_memory_bytes / GiB:.1f} GiB, "
                 f"usable {w.usable_bytes / GiB:.1f} GiB · the bars' full width is {full / GiB:.1f} GiB")
        shared = [n for n in rows[0].plan.notes if all(n in r.plan.notes for r in rows)]
        body = "".join(_bar(r, full, id(r) in best) for r in rows) + \
            f'<p class="notes">{html.escape(" · ".join(shared))}</p>'
    else:
        body = f"<p>{html.escape(why_none)}</p>"
    return (f'<section data-model="{html.escape(model)}" data-gpus="{gpus}"{"" if shown else " hidden"}>'
            f"<h2>{html.escape(head)}</h2>{body}</section>")


def render_page(rows, models: Sequence[str], gpu_counts: Sequence[int], title: str) -> str:
    """The page over every (model, GPU count) pair of `models` × `gpu_counts`; `rows` (commands.plan.Row) are the
    layouts planned, none for a pair whose global batch no layout divides. The bars of one model share one scale
    (its largest bar or the device memory, whichever is larger) so that raising the GPU count shows them shrink."""
    rows, best = ordered(rows)
    first = rows[0].layout
    why_none = (f"no layout: the global batch size {first.global_batch_size} does not divide by micro-batch "
                f"{first.micro_batch_size} × the data-parallel degree of any layout on this GPU count")
    panels = []
    for model in models:
        mine = [r for r in rows if r.model == model]
        full = max([r.plan.worst().memory[r.plan.worst().implementation].total for r in mine]
                   + [r.plan.worst().device_memory_bytes for r in mine], default=1)
        for gpus in gpu_counts:
            panels.append(_panel(model, gpus, [r for r in mine if r.world_size == gpus], best, full,
                                 (model, gpus) == (models[0], gpu_counts[0]), why_none))
    pick_model = "".join(f'<option value="{html.escape(m)}">{html.escape(m)}</option>' for m in models)
    pick_gpus = "".join(f'<option value="{g}">{g}</option>' for g in gpu_counts)
    legend = "".join(f'<i style="background:{colour}"></i>{part}' for part, colour in PART_COLOURS.items())
    legend += ('<i class="device"></i>device memory<i class="usable"></i>usable '
               "(device memory less the plan's headroom)")
    return f"""{HTML_HEAD}{csp_meta_running(SCRIPT)}<title>{html.escape(title)}</title>
<style>{STYLE}</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="pick"><label>model<select id="model">{pick_model}</select></label>
<label>GPUs<select id="gpus">{pick_gpus}</select></label>
<span class="legend">{legend}</span></div>
<p class="notes">Memory per GPU of each layout's worst rank, stacked by part; green where the plan fits under the usable
line, red where it does not; best: the fastest that fits. Choose a model and a GPU count, or open the page at
#model=NAME&amp;gpus=N.</p>
{''.join(panels)}
<script>{SCRIPT}</script></body></html>
"""
