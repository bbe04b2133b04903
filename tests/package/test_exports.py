"""The package root's lazy export table (``gradpress._EXPORTS``, read on first use by ``__getattr__``) and
its ``if TYPE_CHECKING:`` block (what type checkers and IDEs see) name the same things from the same
modules, and every exported name resolves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import gradpress

INIT = Path(gradpress.__file__)


def _type_checking_imports() -> dict[str, str]:
    """Name -> module (relative to the package, e.g. ``hooks.fsdp``) for every import in the root's
    ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(INIT.read_text(), filename=str(INIT))
    blocks = [node for node in tree.body
              if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1, f"{INIT}: expected one `if TYPE_CHECKING:` block, found {len(blocks)}"
    names: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.module, \
            f"{INIT}:{node.lineno}: the TYPE_CHECKING block holds only `from .module import ...` lines"
        for alias in node.names:
            assert alias.asname is None, f"{INIT}:{node.lineno}: {alias.name} imported under another name"
            assert alias.name not in names, f"{INIT}:{node.lineno}: {alias.name} imported twice"
            names[alias.name] = node.module
    return names


def test_the_export_table_and_the_type_checking_block_agree():
    table = gradpress._EXPORTS
    seen = _type_checking_imports()
    assert sorted(set(table) - set(seen)) == [], "exported but missing from the TYPE_CHECKING block"
    assert sorted(set(seen) - set(table)) == [], "in the TYPE_CHECKING block but not exported"
    differ = {name: (table[name], seen[name]) for name in table if table[name] != seen[name]}
    assert differ == {}, "name: (_EXPORTS module, TYPE_CHECKING module)"
    assert gradpress.__all__ == sorted(table)


def test_every_exported_name_resolves_to_its_modules_object():
    for name, module in sorted(gradpress._EXPORTS.items()):
        value = getattr(gradpress, name)
        assert value is getattr(importlib.import_module(f"gradpress.{module}"), name), name
        assert name in dir(gradpress)
