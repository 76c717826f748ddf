"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def test_readme_examples_run(capsys):
    namespace: dict[str, object] = {}
    torch.manual_seed(0)
    # The blocks build on each other (the second uses the first's imports).
    for block in BLOCKS:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    found = re.search(r"MSE (\S+) after (\d+) steps", out)
    assert found is not None, out
    assert float(found.group(1)) < 1e-7
    assert int(found.group(2)) < 1000
    res = namespace["res"]
    assert res.success
    assert res.x[0].item() == pytest.approx(2.5, rel=0.02)
    assert res.x[1].item() == pytest.approx(1.3, rel=0.02)
