"""docs/backends.md's "Adding a backend" walks through a complete, smallest backend: its rank module must implement
every member of the protocol (read from launch/ranks/trainers/protocol.py itself, not listed here) and its registry
entry must give every BackendTraits field that has no default, so the guide cannot drift from the code it teaches."""
import ast
import dataclasses
import re

from launch.config.backends import BackendTraits
from tests.conftest import REPO

GUIDE = (REPO / "docs" / "backends.md").read_text()
SECTION = GUIDE[GUIDE.index("## Adding a backend"):]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)
PROTOCOL = ast.parse((REPO / "launch" / "ranks" / "trainers" / "protocol.py").read_text())


def _protocol_members() -> set[str]:
    (trainer,) = [n for n in PROTOCOL.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    attrs = {n.target.id for n in trainer.body if isinstance(n, ast.AnnAssign)}
    methods = {n.name for n in trainer.body if isinstance(n, ast.FunctionDef)}
    return attrs | methods


def _module_functions() -> set[str]:
    """The functions the protocol's docstring names as a backend module's: `name(args) -> ...` lines."""
    return set(re.findall(r"^    (\w+)\(.*\) -> ", ast.get_docstring(PROTOCOL), re.M))


def test_the_example_module_implements_the_whole_protocol():
    module = ast.parse(BLOCKS[0])
    functions = {n.name for n in module.body if isinstance(n, ast.FunctionDef)}
    assert _module_functions() == {"init_distributed", "build", "export_hf_state"}  # the docstring read as meant
    assert _module_functions() <= functions
    (trainer,) = [n for n in module.body if isinstance(n, ast.ClassDef)]
    methods = {n.name for n in trainer.body if isinstance(n, ast.FunctionDef)}
    init = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in
                [x for tgt in n.targets for x in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
                if isinstance(t, ast.Attribute)}
    missing = _protocol_members() - methods - assigned
    assert not missing, f"the guide's trainer lacks {sorted(missing)}"


def test_the_example_registry_entry_gives_every_required_field():
    entry = ast.parse("dict(" + BLOCKS[1].split("BackendTraits(", 1)[1].rstrip().rstrip(",").rstrip(")") + ")")
    given = {k.arg for k in entry.body[0].value.keywords}
    required = {f.name for f in dataclasses.fields(BackendTraits)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required <= given, f"the guide's registry entry omits {sorted(required - given)}"
    assert given <= {f.name for f in dataclasses.fields(BackendTraits)}, given
