"""docs/jobs.md lists every `zeroxla` subcommand and, in each subcommand's options table, every
option its parser accepts, and nothing the parser does not accept (issue 49).

The parsers are walked as argparse built them (`zeroxla.app.cli.build_parser`, which starts no
JAX backend). On the page, a subcommand's section is the `##` heading that names
`` `zeroxla NAME` ``, up to the next `##` heading; its options are the backticked `--options` in
the first cell of its tables' rows (`--[no-]x` stands for `--x` and `--no-x`). The
subcommand table at the top of the page links every subcommand.
"""

import argparse
import pathlib
import re

import pytest

from zeroxla.app.cli import build_parser

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "jobs.md"
SECTION = re.compile(r"^## .*?`zeroxla (\w+)`.*?$(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
OPTION = re.compile(r"--(\[no-\])?([a-z0-9][a-z0-9-]*)")
CODE = re.compile(r"`([^`\n]*)`")


def parser_options() -> dict[str, set[str]]:
    """{subcommand: its long options}, `-h/--help` left out."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for action in sub._actions for o in action.option_strings
                   if o.startswith("--") and o != "--help"}
            for name, sub in subparsers.choices.items()}


def table_options(section: str) -> set[str]:
    """The options the section's table rows name in their first cell."""
    found = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split(" | ")[0]
        for code in CODE.findall(first_cell):
            for negation, name in OPTION.findall(code):
                found.add(f"--{name}")
                if negation:
                    found.add(f"--no-{name}")
    return found


def page_sections(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in SECTION.finditer(text)}


def differences(parsed: set[str], listed: set[str]) -> tuple[list[str], list[str]]:
    """(missing from the page, on the page but not accepted)."""
    return sorted(parsed - listed), sorted(listed - parsed)


OPTIONS = parser_options()


def test_every_subcommand_has_a_section_and_a_row_in_the_table():
    text = PAGE.read_text()
    summary = text.split("\n## ", 1)[0]
    assert sorted(page_sections(text)) == sorted(OPTIONS)
    listed = set(re.findall(r"^\| \[`zeroxla (\w+)`\]", summary, re.MULTILINE))
    assert listed == set(OPTIONS)


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_the_page_lists_exactly_the_options_the_parser_accepts(command):
    section = page_sections(PAGE.read_text()).get(command, "")
    missing, extra = differences(OPTIONS[command], table_options(section))
    assert (missing, extra) == ([], []), (
        f"docs/jobs.md, `zeroxla {command}`: missing {missing}, not accepted {extra}")


def test_the_check_finds_a_missing_and_an_extra_option():
    section = ("| option | default | what |\n|---|---|---|\n"
               "| `--seed`, `--[no-]check-grad-overflow` | 0 | x |\n| `--gone N` | 1 | y |\n"
               "text naming `--out` outside a table\n")
    listed = table_options(section)
    assert listed == {"--seed", "--check-grad-overflow", "--no-check-grad-overflow", "--gone"}
    assert differences({"--seed", "--check-grad-overflow", "--no-check-grad-overflow", "--out"},
                       listed) == (["--out"], ["--gone"])
