"""The recipe's fields as a person reads them: dotted name, type, default and the comment written beside the field in
the schema (launch/config/schema.py), the one source for `--help` and docs/recipes.md's field reference."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from launch.config import schema


@dataclass(frozen=True)
class FieldDoc:
    section: str  # "" for the top level
    dotted: str  # what an override writes: parallel.tp
    type: str  # e.g. int, "auto" | "never" | str
    default: Any  # REQUIRED when the field has none
    doc: str


REQUIRED = object()


def fields() -> list[FieldDoc]:
    """Every field of `Recipe`, top-level ones first, then each section's in declaration order."""
    out, sections = [], []
    hints, docs = typing.get_type_hints(schema.Recipe), field_comments(schema.Recipe)
    for f in dataclasses.fields(schema.Recipe):
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append((f.name, hints[f.name]))
        else:
            out.append(FieldDoc("", f.name, type_name(hints[f.name]), _default(f), docs.get(f.name, "")))
    for name, cls in sections:
        hints, docs = typing.get_type_hints(cls), field_comments(cls)
        out += [FieldDoc(name, f"{name}.{f.name}", type_name(hints[f.name]), _default(f), docs.get(f.name, ""))
                for f in dataclasses.fields(cls)]
    return out


def section_docs() -> dict[str, str]:
    """Each section's docstring, where the schema gives one."""
    hints = typing.get_type_hints(schema.Recipe)
    out = {}
    for f in dataclasses.fields(schema.Recipe):
        if dataclasses.is_dataclass(hints[f.name]) and (doc := section_doc(hints[f.name])):
            out[f.name] = doc
    return out


def _default(f: dataclasses.Field) -> Any:
    return REQUIRED if f.default is dataclasses.MISSING else f.default


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
