"""The front door: README.md stays a short user's guide whose commands are the ones CI runs,
every link in README.md, CHANGELOG.md and docs/ resolves, no text narrates how a figure
changed across rounds, and README's Python example runs (issue 39).

Links are checked as GitHub renders them: a relative path must exist, and a `#anchor` must be
the slug GitHub gives one of the target page's headings (lower case, punctuation dropped,
spaces to hyphens). Commands are compared with `.ci/run` token by token, up to spellings
that run the same thing (`python -m pip` / `pip`, pip's `-q`, the virtualenv's interpreter).
"""

import math
import pathlib
import re
import shlex

import ci_legs  # tests/support
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_RUN = ROOT / ".ci" / "run"
README_MAX_LINES = 250

# History narration (issue 39): how a figure changed across rounds, or what was tried.
NARRATION = re.compile(
    r"this round|the round before|earlier figures|was [0-9.]+ (MiB|ms|s)\b|"
    r"last round|a round later|earlier round|until this round|was tried|"
    r"a third (quiet )?run|previous layer loop|has always had", re.IGNORECASE)
NARRATION_SOURCES = ("zeroxla", "models", "pallas_kernels", "benchmarks")

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


# ---- markdown, as GitHub reads it --------------------------------------------------------------

def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """`text` without its fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (code spans and links as their text),
    lower case, every character but letters, digits, `_`, `-` and spaces dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (repeats get GitHub's `-1`, `-2`, ... suffixes)."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slug_matches_githubs():
    """Headings of this repository's kinds, with the anchors GitHub gives them."""
    assert slug("Several processes: `zeroxla launch`, SLURM, multi-node GPUs") == \
        "several-processes-zeroxla-launch-slurm-multi-node-gpus"
    assert slug("ZeRO++ (`zeropp.py`)") == "zero-zeropppy"
    assert slug("Activation memory: `remat`") == "activation-memory-remat"
    assert slug("Defaults: the API, `zeroxla train` and a DeepSpeed JSON") == \
        "defaults-the-api-zeroxla-train-and-a-deepspeed-json"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


# ---- README --------------------------------------------------------------------------------------

def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): it is the front door; "
        "move reference material to a page of docs/ and link it")


def _commands(line: str) -> list[list[str]]:
    """A shell line's `&&`-separated commands as argument lists, spelled one way: `python -m
    pip` and `<venv>/bin/pip` as `pip`, any interpreter path as `python`, pip's `-q` dropped."""
    commands = []
    for part in line.split("&&"):
        words = shlex.split(part.strip().rstrip("\\"))
        if words and words[0].endswith(("/python", "/python3")):
            words[0] = "python"
        if words and words[0].endswith("/pip"):
            words = ["python", "-m", "pip", *words[1:]]
        if words[:3] == ["python", "-m", "pip"]:
            words = ["pip", *[w for w in words[3:] if w != "-q"]]
        commands.append(words)
    return commands


def _shell_lines(text: str, needle: str) -> list[str]:
    """The lines of `text`'s bash blocks containing `needle`, continuation lines joined."""
    lines = []
    for language, body in fenced_blocks(text):
        if language == "bash":
            lines += [line for line in body.replace("\\\n", " ").splitlines() if needle in line]
    return lines


def _ci_leg(number: int) -> str:
    """The body of leg `number` in .ci/run (leg 1: its `if` block; leg 2: what follows it)."""
    script = CI_RUN.read_text(encoding="utf-8")
    leg1 = re.search(r'if \[\[ " \$legs " == \*" 1 "\* \]\]; then\n(.*?)\nfi\n', script, re.DOTALL)
    assert leg1, ".ci/run's leg 1 block was not found"
    return leg1.group(1) if number == 1 else script[leg1.end():]


def test_readme_commands_are_what_ci_runs():
    """README's install + tests command is exactly what .ci/run's leg 1 runs, and its install +
    main job command installs the same way (without the `dev` extra) and runs `zeroxla
    train`, the console script pyproject.toml installs."""
    readme = README.read_text(encoding="utf-8")
    leg1 = [line.strip() for line in _ci_leg(1).splitlines() if "pytest" in line]
    assert len(leg1) == 1, leg1
    tests = _shell_lines(readme, "pytest")
    assert tests, "README.md has no bash block running pytest"
    assert _commands(tests[0]) == _commands(leg1[0]), (
        f"README's test command {tests[0]!r} is not what .ci/run's leg 1 runs: {leg1[0]!r}")

    main = _shell_lines(readme, "zeroxla train")
    assert main and _commands(main[0]) == [["pip", "install", "-e", "."], ["zeroxla", "train"]], (
        f"README's main job command is {main[:1]}; expected `pip install -e . && zeroxla train`")
    install = _commands(leg1[0])[0]
    assert install == ["pip", "install", "-e", ".[dev]"], install
    scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n",
                        (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.DOTALL)
    assert scripts and re.search(r'^zeroxla = "', scripts.group(1), re.MULTILINE), (
        "pyproject.toml installs no `zeroxla` console script")


def test_testing_page_gives_ci_leg_2():
    """docs/testing.md's leg-2 commands are what .ci/run's leg 2 runs."""
    leg2 = _ci_leg(2)
    page = (DOCS / "testing.md").read_text(encoding="utf-8")
    ci_pytest = [line for line in leg2.splitlines() if "-m pytest" in line]
    assert len(ci_pytest) == 1, ci_pytest
    ci_install = [line for line in leg2.splitlines() if 'install -q -e ".[dev]"' in line]
    assert len(ci_install) == 1, ci_install
    documented = _shell_lines(page, "second_leg")
    assert documented, "docs/testing.md gives no leg-2 command"
    commands = _commands(documented[0])
    assert commands[1:] == _commands(ci_install[0]) + _commands(ci_pytest[0]), (
        f"docs/testing.md's leg 2 {documented[0]!r} is not what .ci/run runs:\n"
        f"{ci_install[0]}\n{ci_pytest[0]}")
    assert f'"{ci_legs.MARK_EXPRESSION}"' in ci_pytest[0]


def test_readme_links_every_docs_page():
    """Every topic page of docs/ is reachable from README's table of where each topic lives."""
    linked = {m.group(2).split("#")[0] for m in LINK.finditer(prose(README.read_text("utf-8")))}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages <= linked, f"docs pages README does not link: {sorted(pages - linked)}"


# ---- links ---------------------------------------------------------------------------------------

def _pages() -> list[pathlib.Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def broken_links(page: pathlib.Path) -> list[str]:
    """Each relative link of `page` whose file or `#anchor` does not exist, as 'target (why)'."""
    broken = []
    for match in LINK.finditer(prose(page.read_text(encoding="utf-8"))):
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(
                resolved.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading with that anchor in {resolved.name})")
    return broken


def test_link_checker_names_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Sub part\n[ok](#sub-part) [ok](b.md#b) "
                                   "[bad](#nope) [bad](c.md) `[code](x.md)` [web](https://x.y)\n"
                                   "```\n[fenced](y.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links(tmp_path / "a.md") == ["#nope (no heading with that anchor in a.md)",
                                               "c.md (no such file)"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert page.exists(), page
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


# A path in backticks that names a file or folder of this repository (`zeroxla/engine/step.py`,
# `tests/zeroxla/app/`): it must exist too, so a moved module shows up here.
REPO_PATH = re.compile(r"`((?:zeroxla|models|pallas_kernels|tests|benchmarks|examples|notebooks|"
                       r"docs|\.ci)/[\w./-]*)[`\s:]")


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page):
    missing = sorted({m.group(1) for m in REPO_PATH.finditer(page.read_text(encoding="utf-8"))
                      if not (ROOT / m.group(1)).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_notebook_has_its_render():
    """docs/notebooks/ holds each notebook executed (`python docs/render_notebooks.py`)."""
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    renders = {p.stem for p in (DOCS / "notebooks").glob("*.md")}
    assert notebooks == renders, (f"notebooks without a render {sorted(notebooks - renders)}, "
                                  f"renders without a notebook {sorted(renders - notebooks)}")


# ---- no narrated history -------------------------------------------------------------------------

def _narration_files() -> list[pathlib.Path]:
    files = [README, *sorted(DOCS.rglob("*.md"))]
    for folder in NARRATION_SOURCES:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_narration_pattern_catches_the_issues_examples():
    for text in ("11 min 27 s at this round's end", "10 min 48 s the round before",
                 "Earlier figures: 17 min", "temporaries was 107.6 MiB", "it was 41 s",
                 "a longest-first order was tried", "a third quiet run, later"):
        assert NARRATION.search(text), text
    for text in ("rounded to int8", "the rounds' paired ratios", "it was read from"):
        assert not NARRATION.search(text), text


def test_no_narrated_history():
    """README, docs and the package say what is and why, not how a figure changed across
    rounds or what was tried (a docstring's comparison of two designs names both)."""
    found = [f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}: "
             f"{match.group(0)!r}"
             for path in _narration_files()
             for text in [path.read_text(encoding="utf-8")]
             for match in NARRATION.finditer(text)]
    assert not found, "history narration:\n" + "\n".join(found)


# ---- README's example ----------------------------------------------------------------------------

def test_readme_example_runs(tmp_path, monkeypatch):
    """README's Python example, as written, on this process's 8 CPU devices (its XLA_FLAGS line
    comes after JAX started, so it changes nothing here; the environment is restored after)."""
    from flax import nnx

    sections = README.read_text(encoding="utf-8").split("\n## ")
    use_it = next(s for s in sections if s.startswith("Use it"))
    examples = [body for language, body in fenced_blocks(use_it) if language == "python"]
    assert len(examples) == 1, "README's 'Use it' section should hold one Python example"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", __import__("os").environ.get("XLA_FLAGS", ""))
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(examples[0], "README.md (Use it)", "exec"), namespace)
    assert math.isfinite(float(namespace["metrics"]["loss"]))
    assert isinstance(namespace["model"], nnx.Module)
    assert any((tmp_path / "runs").rglob("commit_success.txt")), "no checkpoint was committed"
