"""Every ```python block in docs/ runs, in order, one namespace per file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
# The guide's Lightning block: Lightning's advice for real data loaders, and its own use
# of a torch pytree class that torch has deprecated.
@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_docs_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, f"{page.name} has no python blocks"
    monkeypatch.chdir(tmp_path)  # blocks may write under out/
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
    assert capsys.readouterr().out
