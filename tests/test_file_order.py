"""tests/support/file_order.py: files go to the workers longest first, each file's tests in
their order; the table is rewritten column by column. Checked on stand-in items and a
temporary table against orders and rows worked out by hand."""

from pathlib import Path
from types import SimpleNamespace

import runpy

import file_order

ROOT = Path("/repo")


def _items(paths):
    return [SimpleNamespace(path=ROOT / path, name=f"{path}#{i}") for i, path in enumerate(paths)]


def test_longest_files_first_tests_in_order_files_without_seconds_last_in_collection_order():
    items = _items(["a.py", "b.py", "a.py", "c.py", "d.py", "b.py", "e.py"])
    file_order.order_items(items, ROOT, {"a.py": 1.0, "b.py": 5.0, "d.py": 3.0})
    assert [item.name for item in items] == ["b.py#1", "b.py#5", "d.py#4", "a.py#0", "a.py#2",
                                             "c.py#3", "e.py#6"]


def test_the_tier_and_its_column():
    assert file_order.tier_of("not slow") == "daily"
    assert file_order.tier_of("not slow or second_leg") == "daily"
    assert file_order.tier_of("") == "whole"
    table = {"a.py": (2.0, 9.0), "b.py": (3.0, 0.0)}
    assert file_order.file_seconds(table, "daily") == {"a.py": 2.0, "b.py": 3.0}
    assert file_order.file_seconds(table, "whole") == {"a.py": 9.0, "b.py": 3.0}


def test_write_table_sets_one_column_and_keeps_the_rest(tmp_path):
    table = tmp_path / "file_seconds.py"
    table.write_text('"""doc"""\n\nFILE_SECONDS = {\n    "a.py": (2.0, 9.0),\n}\n')
    file_order.write_table({"a.py": 4.04, "b.py": 1.0}, {"a.py": (2.0, 9.0)}, "daily", table)
    assert runpy.run_path(str(table))["FILE_SECONDS"] == {"a.py": (4.0, 9.0), "b.py": (1.0, 0.0)}
    assert table.read_text().startswith('"""doc"""')
