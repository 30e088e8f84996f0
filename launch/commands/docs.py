"""`python -m launch docs [check=true]`: write the generated parts of docs/ (the recipe field reference in
docs/recipes.md) from the schema (launch/config/schema.py); `check=true` exits 1 where they are stale (what
tests/unit/test_docs.py runs).

The table lists every field of `Recipe` and of each section dataclass: its dotted name (what an override
uses), type, default and the comment written beside or above it in the schema; a section's docstring is
listed below the table. Only the block between `<!-- fields:begin -->` and `<!-- fields:end -->` is touched.
Torch-free: it imports only launch.config.schema.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from launch import REPO_ROOT as REPO
from launch.commands.args import Option, boolean, read
from launch.config import schema

DOC = REPO / "docs" / "recipes.md"
BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the full-line comments right above it, then the one beside it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line)
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            whole = not lines[row - 1][:col].strip()
            comments[row] = (tok.string.lstrip("#").strip(), whole)
    out: dict[str, str] = {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        row = node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        beside = [comments[r][0] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                  if r in comments and not comments[r][1]]
        text = " ".join(above + beside).strip()
        if text:
            out[node.target.id] = text
    return out


def type_name(typ: Any) -> str:
    if get_origin(typ) in (Union, types.UnionType):
        args = [a for a in get_args(typ) if a is not type(None)]
        optional = len(args) < len(get_args(typ))
        return " | ".join(type_name(a) for a in args) + (" (optional)" if optional else "")
    if get_origin(typ) is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in get_args(typ))
    if get_origin(typ) is tuple:
        return f"list of {type_name(get_args(typ)[0])}"
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(typ, getattr(typ, "__name__", str(typ)))


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def section_doc(cls: type) -> str | None:
    """The docstring written in the class (not the signature dataclasses makes up when there is none)."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    return " ".join(doc.split()) if doc else None


def default_cell(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    return "unset" if f.default is None else code(toml_value(f.default))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`"


def rows() -> tuple[list[str], list[str]]:
    table = ["| section | field | type | default | doc |", "|---|---|---|---|---|"]
    notes: list[str] = []
    top_hints = typing.get_type_hints(schema.Recipe)
    top_docs = field_comments(schema.Recipe)
    sections = []
    for f in dataclasses.fields(schema.Recipe):
        typ = top_hints[f.name]
        if dataclasses.is_dataclass(typ):
            sections.append((f.name, typ))
            continue
        default = default_cell(f)
        table.append(f"| top level | `{f.name}` | {code(type_name(typ))} | {default} | {cell(top_docs.get(f.name, ''))} |")
    for name, cls in sections:
        hints = typing.get_type_hints(cls)
        docs = field_comments(cls)
        for f in dataclasses.fields(cls):
            default = default_cell(f)
            table.append(f"| `[{name}]` | `{name}.{f.name}` | {code(type_name(hints[f.name]))} | {default} | "
                         f"{cell(docs.get(f.name, ''))} |")
        doc = section_doc(cls)
        if doc:
            notes.append(f"- `[{name}]`: {doc}")
    return table, notes


def block() -> str:
    table, notes = rows()
    lines = [BEGIN,
             "<!-- generated by `python tools/gen_field_reference.py` from launch/config/schema.py; do not edit -->",
             "", *table]
    if notes:
        lines += ["", *notes]
    lines += ["", END]
    return "\n".join(lines)


def rewrite(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"error: {DOC.relative_to(REPO)} has no {BEGIN} ... {END} block; add the two markers")
    return text[:start] + block() + text[end + len(END):]


USAGE = "usage: python -m launch docs [check=true]"
OPTIONS = (Option("check", "write nothing; exit 1 if a generated part of docs/ is stale", boolean, False),)


def cmd_docs(argv) -> int:
    args = read(argv, command="docs", usage=USAGE, options=OPTIONS)
    text = DOC.read_text(encoding="utf-8")
    new = rewrite(text)
    if args.options["check"]:
        if new != text:
            print(f"{DOC.relative_to(REPO)}: the field reference is stale; run python -m launch docs",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new, encoding="utf-8")
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0

