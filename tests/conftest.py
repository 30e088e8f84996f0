from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe folder under tmp_path/recipes/<name> that extends the shipped base."""

    def _write(name: str, body: str, *, extends: str | None = str(RECIPES / "base")) -> Path:
        d = tmp_path / "recipes" / name
        d.mkdir(parents=True, exist_ok=True)
        head = f'extends = "{extends}"\n' if extends else ""
        (d / "recipe.toml").write_text(head + body)
        return d

    return _write
