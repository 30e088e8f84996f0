"""The documentation holds: README.md stays short, every relative link resolves, the generated parts (the recipe
field reference, the recipe catalogue) are current, and the commands the pages show run (torch-free ones only: dry
runs and the plan chart). tests/unit/test_catalogue_docs.py checks the catalogue's contents."""
from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 200
TWO_COMMANDS = '```bash\nbash launch/install.sh && bash launch/run.sh recipes/tiny_zero2\npython -m pytest -q\n```\n'

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# Where a command starts inside a code span or a code-block line, and how it is run.
STARTS = {"bash launch/run.sh": "dry-run", "bash launch/sweep.sh": "dry-run", "python -m launch plan": "plan"}
# A word that stands for something to fill in: NAME, recipes/A, runs/NAME/<stamp>, [key=value ...], ...
PLACEHOLDER = re.compile(r"^\[|\.\.\.|[<>]|(?<![A-Za-z])[A-Z]+(?![a-z])")


def _prose(text: str) -> str:
    """The page without its code: fenced blocks and inline code spans removed."""
    return INLINE.sub(" ", FENCE.sub("", text))


def _code(text: str) -> list[str]:
    """Each code-block line (continuations joined, comments cut) and each inline code span (one line)."""
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        out += [line.split(" # ")[0].strip() for line in joined.splitlines()]
    out += [" ".join(m.group(2).split()) for m in INLINE.finditer(FENCE.sub("", text))]
    return [c for c in out if c]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8")))}


def shown_commands() -> list[tuple[str, str]]:
    """(kind, command) for every runnable command the pages show verbatim; placeholders (NAME, <stamp>, [...]) skip it."""
    found: dict[str, str] = {}
    for page in PAGES:
        for snippet in _code(page.read_text(encoding="utf-8")):
            for start, kind in STARTS.items():
                i = snippet.find(start)
                if i < 0:
                    continue
                cmd = re.split(r"\s(?:&&|\|\||;|\|)\s", snippet[i:])[0].strip()
                try:
                    words = shlex.split(cmd[len(start):])
                except ValueError:  # unbalanced quotes: not a command line
                    continue
                if not any(PLACEHOLDER.search(w) for w in words):
                    found.setdefault(cmd, kind)
    return sorted((kind, cmd) for cmd, kind in found.items())


COMMANDS = shown_commands()


def test_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    assert TWO_COMMANDS in text, "README.md must keep the install+run and test command block (CI reads it)"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_page_starts_with_a_title_and_a_one_line_summary(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 4 and lines[0].startswith("# ") and not lines[1].strip(), page.name
    assert lines[2].strip() and not lines[3].strip(), f"{page.name}: the summary under the title must be one line"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_generated_docs_are_current():
    """The field reference in docs/recipes.md and the recipe catalogue under recipes/: `python -m launch docs`."""
    r = subprocess.run([sys.executable, "-m", "launch", "docs", "check=true"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    # says so rather than nothing: every generated file counted, none stale
    count = re.search(r"^(\d+) generated file\(s\) .*: 0 stale, (\d+) current$", r.stdout, re.M)
    assert count and count[1] == count[2], r.stdout


def test_the_pages_show_runnable_commands():
    """The collection below is not empty: the flagship's dry run and the plan chart are always shown."""
    shown = {cmd for _, cmd in COMMANDS}
    assert "bash launch/run.sh recipes/7b_tp2_zero3 --dry-run" in shown, sorted(shown)
    assert any(kind == "plan" for kind, _ in COMMANDS), sorted(shown)


@pytest.mark.parametrize("kind,command", COMMANDS, ids=[c for _, c in COMMANDS])
def test_shown_command_runs(kind, command, tmp_path):
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "COLUMNS": "160"}
    argv = shlex.split(command)
    if kind == "dry-run":  # run.sh / sweep.sh: resolve and plan only, whatever the page shows
        # a pattern such as recipes/7b_* is the user's shell's to expand, here as there
        argv = [a for arg in argv for a in (sorted(glob.glob(arg, root_dir=REPO)) if set(arg) & set("*?[") else [arg])]
        if "--dry-run" not in argv:
            argv.append("--dry-run")
        cwd = REPO
    else:  # python -m launch plan: torch-free; writes plans/ under its working directory
        argv = [sys.executable, *argv[1:]]
        cwd = tmp_path
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{command!r} exited {r.returncode}:\n{r.stderr[-2000:]}\n{r.stdout[-2000:]}"


SUBCOMMANDS = sorted({m for page in PAGES
                      for m in re.findall(r"python -m ((?:launch|analysis) [a-z][a-z-]*)", page.read_text(encoding="utf-8"))})


def test_every_subcommand_the_pages_name_answers_help():
    """Commands the pages show with placeholders (export RUN_DIR, calibrate, report PATH ...) run at least --help."""
    assert "launch export" in SUBCOMMANDS and "analysis report" in SUBCOMMANDS, SUBCOMMANDS
    for sub in SUBCOMMANDS:
        r = subprocess.run([sys.executable, "-m", *sub.split(), "--help"], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.startswith("usage: "), f"{sub}: {r.stderr[-1000:]}"
