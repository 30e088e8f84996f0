"""No function in launch/ or analysis/ runs over 80 lines (issue 43: a god function hides its phases). A function that
must be longer is named in LONGER with the reason; none is today."""
import ast

from tests.conftest import REPO

LIMIT = 80
LONGER: dict[str, str] = {}  # "path:function" -> why it cannot be split


def _long_functions(root=REPO, rooms=("launch", "analysis")) -> dict[str, int]:
    found = {}
    for room in rooms:
        for path in sorted((root / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LIMIT:
                        found[f"{path.relative_to(root)}:{node.name}"] = lines
    return found


def test_no_function_is_over_80_lines_without_a_reason():
    unexplained = {name: n for name, n in _long_functions().items() if name not in LONGER}
    assert not unexplained, f"functions over {LIMIT} lines: {unexplained}; split them or say why in LONGER"


def test_the_scan_sees_a_long_function_and_counts_its_def_line(tmp_path):
    (tmp_path / "room").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "room" / "m.py").write_text(f"def fits():\n{body[:body.rindex(chr(10))]}\n\n\ndef long():\n{body}\n")
    assert _long_functions(tmp_path, ("room",)) == {"room/m.py:long": LIMIT + 1}
