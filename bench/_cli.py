"""The bench scripts' one command-line rule, checked before a script's heavy imports: --help (or -h) prints the
script's own docstring and exits 0; any other option that starts with a dash is a usage error: one line naming it and
the script's usage (the docstring's first command line), exit 2."""
from __future__ import annotations

import sys


def help_or_usage(doc: str | None, argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    text = (doc or "").strip()
    if any(a in ("-h", "--help") for a in args):
        print(text)
        raise SystemExit(0)
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        usage = next((line.strip() for line in text.splitlines()
                      if line.strip().startswith(("python ", "torchrun ", "bash "))), "see --help")
        print(f"error: unknown option {unknown[0]}; usage: {usage}", file=sys.stderr)
        raise SystemExit(2)
