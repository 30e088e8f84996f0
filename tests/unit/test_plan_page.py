"""The plan page's selectors (issue 32, the seed's "7B on 4 GPUs, then raise the GPU count"): in headless Chromium the
page opened at #model=NAME&gpus=N shows that pair's panel alone, and its bars marked "fits" are exactly the layouts
that the JSON written beside the page says fit; the page's policy runs its own script and no other."""
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MODELS = ("tinyllama-1.1b", "llama-2-7b")
GPUS = (1, 2, 4, 8)
PAYLOAD = "<script>document.body.setAttribute('data-pwned','script')</script>"


@dataclass
class Bar:
    layout: str
    verdict: str = ""


@dataclass
class Panel:
    model: str
    gpus: str
    hidden: bool
    bars: list[Bar] = field(default_factory=list)


class Panels(HTMLParser):
    """The panels of a dumped DOM (section[data-model]), each with its bars (div[data-layout]) and the text of each
    bar's verdict (span.verdict): what a reader of the page sees, not what the generator meant."""

    def __init__(self):
        super().__init__()
        self.panels: list[Panel] = []
        self.pwned = False
        self._in_verdict = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.pwned = "data-pwned" in a
        elif tag == "section" and "data-model" in a:
            self.panels.append(Panel(a["data-model"], a["data-gpus"], "hidden" in a))
        elif tag == "div" and "data-layout" in a:
            self.panels[-1].bars.append(Bar(a["data-layout"]))
        self._in_verdict = tag == "span" and a.get("class") == "verdict"

    def handle_endtag(self, tag):
        self._in_verdict = False

    def handle_data(self, data):
        if self._in_verdict:
            self.panels[-1].bars[-1].verdict += data


def _open(page, fragment: str) -> Panels:
    """The page's DOM after Chromium opened it at `fragment` and ran what the page's policy let run."""
    assert CHROMIUM, "headless Chromium is needed for this test: apt-get install chromium (.ci/run does)"
    profile = page.parent / f"profile-{len(list(page.parent.glob('profile-*')))}"
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=2000",
                        f"--user-data-dir={profile}", "--dump-dom", page.as_uri() + fragment],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    dom = Panels()
    dom.feed(p.stdout)
    return dom


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The page and the JSON rows of two models on 1, 2, 4 and 8 GPUs, as a user writes them."""
    d = tmp_path_factory.mktemp("plan")
    p = subprocess.run([sys.executable, "-m", "launch", "plan", f"model={','.join(MODELS)}",
                        f"world_size={','.join(map(str, GPUS))}", f"out={d / 'p'}"], cwd=d,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(d / "runs")}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return d / "p.html", json.loads((d / "p.json").read_text())


def _shown(dom: Panels) -> Panel:
    assert sorted((p.model, p.gpus) for p in dom.panels) == sorted((m, str(g)) for m in MODELS for g in GPUS)
    (shown,) = [p for p in dom.panels if not p.hidden]  # every other panel hidden
    return shown


@pytest.mark.parametrize("model,gpus", [("llama-2-7b", 4), ("llama-2-7b", 8), ("tinyllama-1.1b", 1)])
def test_the_selected_pair_shows_exactly_the_layouts_that_fit(plan, model, gpus):
    page, rows = plan
    shown = _shown(_open(page, f"#model={model}&gpus={gpus}"))
    assert (shown.model, shown.gpus) == (model, str(gpus))
    mine = [r for r in rows if r["model"] == model and r["world_size"] == gpus]
    assert sorted(b.layout for b in shown.bars) == sorted(r["layout"] for r in mine)
    assert {b.verdict for b in shown.bars} <= {"fits", "does not fit"}
    fitting = {r["layout"] for r in mine if r["plan"]["fits"]}
    assert fitting and {b.layout for b in shown.bars if b.verdict == "fits"} == fitting


def test_without_a_choice_the_first_pair_shows(plan):
    page, _ = plan
    shown = _shown(_open(page, ""))
    assert (shown.model, shown.gpus) == (MODELS[0], str(GPUS[0]))


def test_the_policy_runs_the_pages_script_and_no_injected_one(plan):
    """A payload in the markup stays dead while the page's own script (allowed by its hash) picks the panel; the
    same payload without the policy runs: the oracle that the check can fail."""
    page, _ = plan
    injected = page.with_name("injected.html")
    injected.write_text(page.read_text().replace("<script>", PAYLOAD + "<script>", 1))
    dom = _open(injected, "#model=llama-2-7b&gpus=8")
    shown = _shown(dom)
    assert not dom.pwned and (shown.model, shown.gpus) == ("llama-2-7b", "8")
    open_page = page.with_name("open.html")
    open_page.write_text(re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", injected.read_text()))
    assert _open(open_page, "").pwned


def test_a_json_an_older_plan_wrote_is_still_ours_to_replace(tmp_path):
    """Rows without "model" (plan before it took several models) are replaced, not refused; a row with a key of
    someone else's is not ours."""
    from launch.commands.plan_figure import ours

    old, theirs = tmp_path / "old.json", tmp_path / "theirs.json"
    old.write_text(json.dumps([{"world_size": 4, "layout": "DP", "plan": {}}]))
    theirs.write_text(json.dumps([{"model": "x", "world_size": 4, "layout": "DP", "plan": {}, "note": ""}]))
    assert ours(old) and not ours(theirs)
