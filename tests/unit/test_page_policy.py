"""Every HTML page a command writes carries a Content-Security-Policy that runs no script but the page's own: checked
in headless Chromium on a report whose escaping is deliberately broken, so that a payload reaches the markup as
markup (the plan page's own script: tests/unit/test_plan_page.py)."""
import html
import re
import shutil
import subprocess
import sys

import pytest

from analysis.report import build_report, write_report
from launch.pages import CSP, CSP_META
from tests.unit.report_support import REPO, make_run_dir

REPO_BENCH = REPO / "bench"

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RAN = re.compile(r"<body[^>]*data-pwned=")  # what a payload that ran leaves on the body element
PAYLOADS = ("<script>document.body.setAttribute('data-pwned','script')</script>",
            "<img src=x onerror=\"document.body.setAttribute('data-pwned','onerror')\">",
            "<iframe src=\"https://example.com/\"></iframe>")


def _dom(page) -> str:
    """The page's DOM after Chromium loaded it (and ran whatever it was allowed to run)."""
    assert CHROMIUM, "headless Chromium is needed for this test: apt-get install chromium (.ci/run does)"
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=2000",
                        f"--user-data-dir={page.parent / 'profile'}", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.fixture
def broken_report(tmp_path, monkeypatch):
    """A report whose run label is a script, written with html.escape made to do nothing."""
    d = make_run_dir(tmp_path, traces=False)
    rep = build_report([("".join(PAYLOADS), d)])
    monkeypatch.setattr(html, "escape", lambda s, quote=True: s)
    (page,) = write_report(rep, [tmp_path / "r.html"])
    monkeypatch.undo()
    text = page.read_text()
    assert all(p in text for p in PAYLOADS)  # the escaping really is broken: the markup is there
    return page


def test_a_report_with_broken_escaping_runs_no_script(broken_report):
    dom = _dom(broken_report)
    assert "<body" in dom and not RAN.search(dom), dom[:3000]


def test_without_the_policy_the_same_page_would_run_it(broken_report):
    """The oracle that the check can fail: the same page with its policy removed runs the payload."""
    open_page = broken_report.with_name("open.html")
    open_page.write_text(broken_report.read_text().replace(CSP_META, ""))
    assert RAN.search(_dom(open_page))


def test_every_page_we_write_carries_the_policy(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "world_size=4", f"out={tmp_path / 'p'}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # the plan page's policy is the same one, letting its own script run by hash (tests/unit/test_plan_page.py)
    policy = f'<meta http-equiv="Content-Security-Policy" content="{CSP}; script-src \'sha256-'
    assert policy in (tmp_path / "p.html").read_text()


def test_a_256_rank_report_renders_in_headless_chromium_within_its_time(tmp_path):
    """Issue 31: 256 ranks (copies of our gloo trace, each stating its rank, built as bench/bench_scale.py builds
    them) give a page that Chromium loads and lays out in well under a minute, their tables as distributions."""
    import importlib.util
    import time

    from tests.unit.report_support import GLOO

    spec = importlib.util.spec_from_file_location("bench_scale", REPO_BENCH / "bench_scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.build_ranks(GLOO[0], 256, tmp_path / "ranks")
    (page,) = write_report(build_report([(None, tmp_path / "ranks")]), [tmp_path / "r.html"])
    start = time.monotonic()
    dom = _dom(page)
    assert time.monotonic() - start < 60
    assert "256 ranks" in dom or "worst ranks" in dom, dom[:2000]
