"""The report's figures, drawn with matplotlib's object API (no pyplot state) and returned as PNG bytes, and the
busbw-vs-size plot of `python -m analysis busbw` (`busbw_plot`, written to a PNG file).

Each function takes plain numbers already computed by the analyzers; none reads a file or computes
a statistic beyond placing points.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from analysis.analyzers.ceilings import Panel
from analysis.analyzers.curves import segments

_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974",
           "#64B5CD")
SEGMENT_COLORS = {"compute": "#4C72B0", "other": "#BBBBBB", "idle": "#EEEEEE"}


def plain_text(text: object) -> str:
    """`text` drawn as written. Matplotlib reads text between two `$` as mathtext and raises on what is
    not TeX; a label here is a run name, a file name or a collective, never a formula."""
    return str(text).replace("$", r"\$")


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def step_time_distribution(series: Sequence[tuple[str, Sequence[float]]]) -> bytes:
    """Box plot of measured step times per run, every step drawn as a point over it."""
    fig = Figure(figsize=(7.5, 0.6 + 0.55 * max(1, len(series))))
    ax = fig.add_subplot()
    labels = [plain_text(s[0]) for s in series]
    data = [[t * 1e3 for t in s[1]] for s in series]
    ax.boxplot(data, orientation="horizontal", widths=0.5, showfliers=False)
    for i, vals in enumerate(data, start=1):
        n = len(vals)
        ys = [i + 0.18 * (((k * 0.618) % 1.0) - 0.5) for k in range(n)]
        ax.scatter(vals, ys, s=10, alpha=0.6, color=_COLORS[(i - 1) % len(_COLORS)], zorder=3)
    ax.set_yticks(range(1, len(labels) + 1), labels)
    ax.set_xlabel("step time, ms (measured window, warm-up excluded)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def time_breakdown_bars(bars: Sequence[tuple[str, Mapping[str, float]]]) -> bytes:
    """Stacked horizontal bars, one per run: shares (%) of the measured span.

    Segment names: 'compute', 'exposed <collective>' ..., 'other', 'idle'; missing ones are 0.
    """
    names: list[str] = []
    for _, segs in bars:
        for k in segs:
            if k not in names:
                names.append(k)
    order = ["compute"] + sorted(n for n in names if n.startswith("exposed ")) + ["other", "idle"]
    order = [n for n in order if n in names]
    fig = Figure(figsize=(7.5, 0.9 + 0.5 * max(1, len(bars))))
    ax = fig.add_subplot()
    comm_colors = iter(_COLORS[1:])
    colors = {n: SEGMENT_COLORS.get(n) or next(comm_colors, "#999999") for n in order}
    for i, (label, segs) in enumerate(bars):
        left = 0.0
        for n in order:
            w = segs.get(n, 0.0)
            ax.barh(i, w, left=left, color=colors[n], edgecolor="white", label=plain_text(n) if i == 0 else None)
            left += w
    for n in order:  # legend entries for segments absent from the first bar
        if not bars or n not in bars[0][1]:
            ax.barh(0, 0, color=colors[n], label=plain_text(n))
    ax.set_yticks(range(len(bars)), [plain_text(b[0]) for b in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the measured span (mean over ranks)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(5, len(order)), fontsize=8, frameon=False)
    return _png(fig)


def memory_per_rank(groups: Sequence[tuple[str, Sequence[tuple[str, float, float | None]]]],
                    device_gib: float | None = None) -> bytes:
    """Measured peak per rank (bars) and the plan's prediction (black ticks), GiB, grouped by run.

    With several runs each is numbered: ticks read `run number:rank`, the legend gives each number's
    run (labels are too long for ticks and often share their first characters)."""
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    x = 0.0
    ticks, labels = [], []
    several = len(groups) > 1
    for gi, (run, ranks) in enumerate(groups):
        color = _COLORS[gi % len(_COLORS)]
        name = plain_text(f"{gi + 1}: {run}" if several else run)
        for k, (rank, measured, predicted) in enumerate(ranks):
            ax.bar(x, measured, width=0.8, color=color, label=name if k == 0 else None)
            if predicted is not None:
                ax.plot([x - 0.45, x + 0.45], [predicted, predicted], color="black", lw=2,
                        label="plan prediction" if gi == 0 and k == 0 else None)
            ticks.append(x)
            labels.append(plain_text(f"{gi + 1}:{rank}" if several else rank))
            x += 1
        x += 0.8
    top = max([m for _, rs in groups for _, m, _ in rs] + [p for _, rs in groups for _, _, p in rs if p] + [0.0])
    if device_gib and device_gib <= 2 * top:
        ax.axhline(device_gib, color="#C44E52", ls="--", lw=1, label="device memory")
    elif device_gib:  # a limit far above every bar would flatten them: name it instead
        ax.text(0.99, 0.97, f"device memory {device_gib:.0f} GiB (off scale)", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#C44E52")
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_xlabel("run:rank" if several else "rank")
    ax.set_ylabel("peak memory, GiB")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def busbw_vs_size(points: Sequence[tuple[str, Sequence[tuple[float, float]]]],
                  ceilings: Sequence[tuple[str, Sequence[tuple[float, float]]]]) -> bytes:
    """Achieved bus bandwidth of each collective call against its message size (points), with the
    nccl-tests sweeps (lines), log-log."""
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.add_subplot()
    for i, (label, pts) in enumerate(points):
        pts = [(s, b) for s, b in pts if s and b and s > 0 and b > 0]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.7, color=_COLORS[i % len(_COLORS)],
                       label=plain_text(label))
    for j, (label, curve) in enumerate(ceilings):
        curve = sorted((s, b) for s, b in curve if s and b and s > 0 and b > 0)
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], lw=1.5, ls="-", marker=".",
                    color=_COLORS[(j + 5) % len(_COLORS)], label=plain_text(label))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("bus bandwidth, GB/s")
    ax.grid(which="both", alpha=0.2)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False, loc="best")
    return _png(fig)


def training_curves(series: Sequence[tuple[str, Sequence[int], Mapping[str, Sequence[float | None]]]]) -> bytes:
    """training_curves_figure as PNG bytes."""
    return _png(training_curves_figure(series))


def training_curves_figure(series: Sequence[tuple[str, Sequence[int], Mapping[str, Sequence[float | None]]]]) -> Figure:
    """Three panels side by side — loss, gradient norm, learning rate — against the step, one line per run; a
    missing value leaves a gap. A run's validation loss (`valid_loss`, where it has one) is drawn on the loss panel in
    the run's colour, dashed with markers. A run whose steps fall back or jump far (another job in the same file:
    analyzers.curves.segments) gets a row of panels per segment, each on its own step axis."""
    panels = [("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate")]
    rows: list[list[tuple[int, str, Sequence[int], Mapping[str, Sequence[float | None]]]]] = []
    for i, (label, steps, values) in enumerate(series):
        parts = segments(steps)
        for k, (a, b) in enumerate(parts):
            while len(rows) <= k:
                rows.append([])
            rows[k].append((i, f"{label} #{k + 1}" if len(parts) > 1 else label, steps[a:b],
                            {key: vals[a:b] for key, vals in values.items()}))
    # constrained: each panel's tick labels get their own room, not the next panel's (they were drawn over it)
    fig = Figure(figsize=(11, 3.2 * len(rows)), layout="constrained")
    grid = fig.subplots(len(rows), 3, squeeze=False)
    for k, (axes, row) in enumerate(zip(grid, rows, strict=True)):
        for ax, (key, title) in zip(axes, panels, strict=True):
            for i, label, steps, values in row:
                ys = [float("nan") if v is None else v for v in values[key]]
                if any(v == v for v in ys):
                    ax.plot(steps, ys, label=plain_text(label), color=_COLORS[i % len(_COLORS)], linewidth=1.2)
                if key == "loss" and any(v is not None for v in values.get("valid_loss", ())):
                    points = [(s, v) for s, v in zip(steps, values["valid_loss"], strict=True) if v is not None]
                    ax.plot([s for s, _ in points], [v for _, v in points], label=plain_text(f"{label} (validation)"),
                            color=_COLORS[i % len(_COLORS)], linestyle="--", marker="o", markersize=3, linewidth=1)
            ax.set_title(title if len(rows) == 1 else f"{title} (segment {k + 1})")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            # learning rates (1e-5..1e-3) as 0.5 … 3.0 with ×10⁻⁴ once above the axis, not "0.00030" per tick
            formatter = ScalarFormatter(useMathText=True)
            formatter.set_powerlimits((-2, 3))
            ax.yaxis.set_major_formatter(formatter)
        if axes[0].get_legend_handles_labels()[0]:
            axes[0].legend(fontsize=7)
    return fig


# ------------------------------------------------------------------------ busbw vs size (python -m analysis busbw)

_PLACEMENT_TITLES = {"median": "median of both placements", "out-of-place": "out-of-place",
                     "in-place": "in-place"}


def busbw_plot(panels: Sequence[Panel], *, nominal_GBps: float | None = None, out_png: str | Path,
               placement: str = "median", title: str | None = None) -> Path:
    """Draw bus bandwidth vs message size (log x), one panel per collective and one line per table, from
    analysis.analyzers.ceilings.busbw_panels; NVIDIA nccl-tests' lines dashed, the nominal link busbw as a dashed
    reference. Writes `out_png` and returns its path."""
    from matplotlib import rcParams
    from matplotlib.ticker import FuncFormatter, LogLocator

    if not panels:
        raise ValueError("busbw_plot: no collective to draw")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5.2 * cols, 3.9 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, object] = {}
    for ax, (op, lines) in zip(axes.flat, panels):
        for i, label, curve in lines:
            style = "--" if "nccl-tests" in label else "-"
            (line,) = ax.plot([s for s, _ in curve], [b for _, b in curve], style, marker="o", markersize=3,
                              linewidth=1.6, color=colors[i % len(colors)])
            handles.setdefault(label, line)
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
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(plain_text(title) if title else
                 f"bus bandwidth vs message size ({_PLACEMENT_TITLES.get(placement, placement)}; dashed reference: "
                 f"nominal link busbw)", fontsize=12)
    fig.legend(list(handles.values()), [plain_text(h) for h in handles], loc="lower center",
               ncol=min(3, len(handles)), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.0))
    legend_rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.02, 1, 0.95))
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, metadata={"Software": BUSBW_SOFTWARE})
    return out


# The PNG's Software text: an earlier plot of ours at -o is replaced, anything else there is refused.
BUSBW_SOFTWARE = "layoutlab python -m analysis busbw"


def is_our_busbw_png(path: Path) -> bool:
    """Whether `path` is a PNG busbw_plot wrote (its Software chunk comes before the image data)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and BUSBW_SOFTWARE.encode() in head


def _bytes(x: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if x >= size:
            return f"{x / size:g}{unit}"
    return f"{x:g}"
