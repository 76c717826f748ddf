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


# The flat layout before the family packages: module path -> where the code lives now.
OLD_PATHS = {
    "secondorder.backends": "secondorder.lm.backends",
    "secondorder.config": "secondorder.lm.config",
    "secondorder.curve_fit": "secondorder.fitting.curve_fit",
    "secondorder.damping": "secondorder.lm.damping",
    "secondorder.distributed.solve": "secondorder.lm.sharded",
    "secondorder.engine": "secondorder.lm.engine",
    "secondorder.fit": "secondorder.training.fit",
    "secondorder.jacobian": "secondorder.lm.jacobian",
    "secondorder.least_squares": "secondorder.fitting.least_squares",
    "secondorder.linalg": "secondorder.lm.linalg",
    "secondorder.planner": "secondorder.lm.planner",
    "secondorder.precision": "secondorder.lm.precision",
    "secondorder.residuals": "secondorder.lm.residuals",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_module_paths_of_the_flat_layout_still_import(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(OLD_PATHS[old])


def test_old_from_imports_keep_working() -> None:
    from secondorder.curve_fit import curve_fit, fit_report
    from secondorder.fit import CSVLogger, fit
    from secondorder.lm import LevenbergMarquardt, StepInfo
    from secondorder.residuals import ModelResidual, mse

    assert fit is so.fit and curve_fit is so.curve_fit and fit_report is so.fit_report
    assert CSVLogger is so.CSVLogger and LevenbergMarquardt is so.LevenbergMarquardt
    assert StepInfo is so.StepInfo and ModelResidual is so.ModelResidual
    assert mse is so.residuals.mse
    # so.fit and so.curve_fit stay the functions; the modules keep their attributes.
    assert callable(so.fit) and callable(so.curve_fit)
    assert so.engine is importlib.import_module("secondorder.lm.engine")
