#!/usr/bin/env bash
# README's first command, its install half: the project and every test prerequisite into the Python that runs it
# (a fresh virtual environment is what README assumes), resolved against constraints.txt, so a new machine gets the
# versions CI tested (a loose `pytest>=8` once resolved to a pytest that rejected a test's nested approx), and
# headless Chromium, which the page tests drive (it is not on PyPI; Debian's package is the one CI uses).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]" -c constraints.txt
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  exit 0
fi
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "installing headless Chromium for the page tests (apt-get install chromium)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  # Not root, or not Debian: the rest works; the page tests say what is missing when they run.
  echo "warning: no chromium on PATH; the page tests need it: sudo apt-get install chromium (or your system's package)" >&2
fi
