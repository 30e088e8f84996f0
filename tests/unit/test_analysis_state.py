"""analysis/ holds no hidden state between calls: no module-level container that code mutates, no `global`, no
memoising decorator. A cache belongs to an object its caller holds (analysis.analyzers.trace_analysis.TraceScopes)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANALYSIS = ROOT / "analysis"
MODULES = sorted(ANALYSIS.rglob("*.py"))

_CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "Counter", "OrderedDict", "deque", "bytearray"}
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
             "discard", "sort", "reverse", "appendleft", "popleft", "extendleft", "difference_update",
             "intersection_update", "symmetric_difference_update", "__setitem__", "__delitem__"}
_MEMOISERS = {"cache", "lru_cache", "cached_property"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in _CONTAINER_CALLS
    return False


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's own statements, those inside top-level if / try blocks included."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return out


def _containers(tree: ast.Module) -> set[str]:
    """Names the module binds to a mutable container at its top level."""
    names = set()
    for node in _top_level(tree):
        if isinstance(node, ast.Assign) and _is_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_container(node.value):
            names.add(node.target.id)
    return names


def _aliases(tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """Local name -> analysis module, for the analysis modules this one imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname: a.name for a in node.names if a.asname and a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in modules}
    return out


def _mutated(node: ast.AST) -> ast.expr | None:
    """The container expression `node` mutates in place, if it does."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript):
                return t.value
            if isinstance(node, ast.AugAssign) and isinstance(t, (ast.Name, ast.Attribute)):
                return t
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        return node.func.value
    return None


def _offences(path: Path, trees: dict[str, ast.Module], containers: dict[str, set[str]]) -> list[str]:
    tree = trees[_module_name(path)]
    own = containers[_module_name(path)]
    aliases = _aliases(tree, set(trees))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Global):
            out.append(f"{where}: global {', '.join(node.names)}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in _MEMOISERS:
                    out.append(f"{where}: @{name} on {node.name} keeps results between calls")
        target = _mutated(node)
        if isinstance(target, ast.Name) and target.id in own:
            out.append(f"{where}: mutates the module-level {target.id}")
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
              and target.value.id in aliases and target.attr in containers[aliases[target.value.id]]):
            out.append(f"{where}: mutates {aliases[target.value.id]}.{target.attr}")
    return out


def test_no_module_level_state_in_analysis():
    trees = {_module_name(p): ast.parse(p.read_text(), str(p)) for p in MODULES}
    containers = {name: _containers(tree) for name, tree in trees.items()}
    offences = [o for p in MODULES for o in _offences(p, trees, containers)]
    assert not offences, "\n".join(offences)


@pytest.mark.parametrize("source, found", [
    ("_SEEN = {}\ndef f(k):\n    _SEEN[k] = 1\n", "mutates the module-level _SEEN"),
    ("_SEEN: list[int] = []\ndef f(k):\n    _SEEN.append(k)\n", "mutates the module-level _SEEN"),
    ("_N = 0\ndef f():\n    global _N\n    _N += 1\n", "global _N"),
    ("import functools\n@functools.lru_cache(None)\ndef f(k):\n    return k\n", "@lru_cache on f"),
    ("from analysis.parsers import kineto as k\ndef f():\n    k.CACHE.clear()\n",
     "mutates analysis.parsers.kineto.CACHE"),
])
def test_the_check_finds_hidden_state(tmp_path, source, found):
    """The rule above catches each kind of hidden state it names (a planted module beside the real ones)."""
    planted = ANALYSIS / "planted.py"
    trees = {_module_name(p): ast.parse(p.read_text()) for p in MODULES}
    trees[_module_name(planted)] = ast.parse(source)
    containers = {name: _containers(tree) for name, tree in trees.items()}
    containers["analysis.parsers.kineto"] = containers["analysis.parsers.kineto"] | {"CACHE"}
    offences = _offences(planted, trees, containers)
    assert len(offences) == 1 and found in offences[0], offences
