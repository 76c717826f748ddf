"""Every public name the README and the guide use resolves, and so do the old module paths."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import secondorder as so

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _attribute_chains() -> list[str]:
    """``so.X``, ``so.X.Y`` and ``secondorder.X.Y`` as written in the README and guide."""
    found: set[str] = set()
    for path in TEXTS:
        text = path.read_text(encoding="utf-8")
        found |= {m for m in re.findall(r"\bso\.([A-Za-z_][\w.]*[A-Za-z_0-9])", text)}
        found |= {m for m in re.findall(r"\bsecondorder\.([A-Za-z_][\w.]*[A-Za-z_0-9])", text)}
    return sorted(found)


def _imports() -> list[tuple[str, str]]:
    """``from secondorder... import a, b`` statements in the README and guide."""
    found: set[tuple[str, str]] = set()
    for path in TEXTS:
        text = path.read_text(encoding="utf-8")
        for module, names in re.findall(r"from (secondorder[\w.]*) import ([\w, ]+)", text):
            found |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    return sorted(found)


def _resolve(chain: str) -> object:
    """The object ``secondorder.<chain>``: the longest importable module, then attributes."""
    parts = chain.split(".")
    for cut in range(len(parts), -1, -1):
        try:
            obj: object = importlib.import_module(".".join(["secondorder", *parts[:cut]]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError(chain)  # pragma: no cover - "secondorder" itself imports


@pytest.mark.parametrize("chain", _attribute_chains())
def test_names_the_docs_use_resolve(chain: str) -> None:
    assert _resolve(chain) is not None


@pytest.mark.parametrize(("module", "name"), _imports())
def test_imports_the_docs_use_work(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_everything_in_all_resolves() -> None:
    for name in so.__all__:
        assert getattr(so, name) is not None, name


# Module paths of a layout that was never released: they are gone, not aliased.
NO_ALIASES = (
    "secondorder.backends",
    "secondorder.config",
    "secondorder.engine",
    "secondorder.jacobian",
    "secondorder.linalg",
    "secondorder.planner",
    "secondorder.precision",
    "secondorder.residuals",
    "secondorder.lm.sharded",
    "secondorder.lm.cg",
)


@pytest.mark.parametrize("old", NO_ALIASES)
def test_flat_layout_module_paths_are_not_aliased(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
