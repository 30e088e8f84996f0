"""The report's two renderers: Markdown with PNG figures beside it, and one self-contained HTML file; both write the
blocks of analysis.report.sections, escaping every string read from logs and traces."""
from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any, Iterable

from analysis.parsers.recognize import HTML_HEAD, MD_HEAD
from analysis.report.data import Report
from analysis.report.sections import report_blocks
from launch.errors import printable
from launch.outputs import write_bytes_atomic, write_text_atomic
from launch.pages import CSP_META

# ---- Markdown

def _md_cell(text: Any) -> str:
    s = html.escape(printable(str(text), keep="\n\t"), quote=False).replace("|", "\\|").replace("\n", " ").replace("\r", " ")
    # `$` too: renderers with math (GitHub) would read text between two of them as a formula
    return (s.replace("`", "\\`").replace("*", "\\*").replace("[", "\\[").replace("]", "\\]")
            .replace("$", "\\$"))


def render_markdown(rep: Report, out_path: str | os.PathLike[str]) -> list[Path]:
    """Write the report as Markdown; figures go beside it as PNG files. Returns the files written."""
    out = Path(out_path)
    plots_dir = out.with_name(out.stem + "_plots")
    written = [out]
    lines = [*MD_HEAD.splitlines(), ""]
    n_img = 0
    folds = []  # the per-rank tables, kept for the appendix at the end
    for b in report_blocks(rep):
        if b.kind in ("h2", "h3"):
            lines += [("## " if b.kind == "h2" else "### ") + _md_cell(b.text), ""]
        elif b.kind == "p":
            lines += [_md_cell(b.text), ""]
        elif b.kind in ("list", "details"):
            if b.text:
                lines += [f"**{_md_cell(b.text)}**", ""]
            lines += [f"- {_md_cell(i)}" for i in b.items] + [""]
        elif b.kind == "table":
            lines += _md_table(b)
        elif b.kind == "fold":
            folds.append(b)
            lines += [f"*{_md_cell(b.text)}: in the appendix.*", ""]
        elif b.kind == "img":
            n_img += 1
            plots_dir.mkdir(parents=True, exist_ok=True)
            f = plots_dir / f"figure{n_img}.png"
            write_bytes_atomic(f, b.png)
            written.append(f)
            lines += [f"![{_md_cell(b.text)}]({plots_dir.name}/{f.name})", "", f"*{_md_cell(b.text)}*", ""]
    if folds:
        lines += ["## Appendix: every rank", ""]
        for b in folds:
            lines += [f"### {_md_cell(b.text)}", "", *_md_table(b)]
    write_text_atomic(out, "\n".join(lines))
    return written


def _md_table(b) -> list[str]:
    return ["| " + " | ".join(_md_cell(h) for h in b.headers) + " |", "|" + "---|" * len(b.headers),
            *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows), ""]


# ---- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1400px;
color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.85em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.src{color:#666;font-size:.9em;max-width:28em;word-break:break-all}
tr.warn td{background:#fff6e5}figure{margin:1em 0}figcaption{color:#555;font-size:.85em}
details{margin:.3em 0}summary{cursor:pointer}ul{margin:.3em 0 1em}li{margin:.1em 0}
"""
_NUMERIC = set("0123456789.,–-% ")


def _is_num(cell: str) -> bool:
    return bool(cell) and all(ch in _NUMERIC for ch in cell) or cell.endswith(("GiB", "MiB", "KiB", " B"))


def render_html(rep: Report, out_path: str | os.PathLike[str]) -> list[Path]:
    """Write one self-contained HTML file: inline CSS, figures as base64 PNG, no scripts, no links out."""
    # One-letter escaper keeps the markup readable; control characters (ANSI escapes read from logs) as escapes.
    e = lambda s: html.escape(printable(str(s), keep="\n\t"), quote=True)  # noqa: E731
    parts = [HTML_HEAD, CSP_META,
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>layoutlab report</title><style>", _CSS, "</style></head><body><h1>layoutlab report</h1>"]
    for b in report_blocks(rep):
        if b.kind in ("h2", "h3"):
            parts.append(f"<{b.kind}>{e(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{e(b.text)}</p>")
        elif b.kind == "list":
            if b.text:
                parts.append(f"<p><strong>{e(b.text)}</strong></p>")
            parts.append("<ul>" + "".join(f"<li>{e(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "details":
            parts.append(f"<details><summary>{e(b.text)}</summary><ul>"
                         + "".join(f"<li>{e(i)}</li>" for i in b.items) + "</ul></details>")
        elif b.kind == "table":
            parts.append(_html_table(b, e))
        elif b.kind == "fold":
            parts.append(f"<details><summary>{e(b.text)}</summary>{_html_table(b, e)}</details>")
        elif b.kind == "img":
            data = base64.b64encode(b.png).decode("ascii")
            parts.append(f"<figure><img alt='{e(b.text)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{e(b.text)}</figcaption></figure>")
    parts.append("</body></html>")
    out = Path(out_path)
    write_text_atomic(out, "".join(parts))
    return [out]


def _html_table(b, e) -> str:
    """A table; the source column's cells small, numbers right-aligned, each cell titled by its row's source."""
    src_col = len(b.headers) - 1 if b.headers and b.headers[-1] == "source" else -1
    sev_col = list(b.headers).index("severity") if "severity" in b.headers else -1
    rows = []
    for row in b.rows:
        cls = " class='warn'" if sev_col >= 0 and row[sev_col] == "warn" else ""
        cells = []
        for i, c in enumerate(row):
            c = str(c)
            kind = " class='src'" if i == src_col else (" class='n'" if _is_num(c) else "")
            title = f" title='source: {e(row[src_col])}'" if src_col >= 0 and i != src_col else ""
            cells.append(f"<td{kind}{title}>{e(c)}</td>")
        rows.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return ("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in b.headers) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def write_report(rep: Report, outputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Write each output by its suffix: .html/.htm or .md/.markdown."""
    written: list[Path] = []
    for o in outputs:
        suffix = Path(o).suffix.lower()
        Path(o).parent.mkdir(parents=True, exist_ok=True)
        if suffix in (".html", ".htm"):
            written += render_html(rep, o)
        elif suffix in (".md", ".markdown"):
            written += render_markdown(rep, o)
        else:
            raise ValueError(f"-o {o}: the suffix decides the format; use .html or .md")
    return written
