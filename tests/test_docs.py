"""The docs, checked: a short README that still holds the two commands and links every docs/ page, relative links
(and their anchors) that resolve, and a docs/flags.md that is the generator's output and lists every flag the real
parser accepts. Fast: no torch, no subprocess."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from scaletrain.config.cli import build_parser
from tests.harness import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
FLAGS_MD = DOCS / "flags.md"
MAX_README_LINES = 300
TWO_COMMANDS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "deepspeed train.py --config ds_configs/zero3.json",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . -r requirements-dev.txt && python -m pytest",
)
FRONT_DOOR_LINES = 40  # what a newcomer skims: what this is, the two commands, what the job writes, the fast tier
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def flags_reference():
    """scripts/flags_reference.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("flags_reference", REPO / "scripts" / "flags_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_pages() -> list:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """Markdown without its code blocks and code spans, where a link is no link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list:
    return LINK.findall(prose(text))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, ...


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    found, seen = set(), {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list:
    """[(target, why)] for every relative link of `page` that does not resolve (file, or anchor in a .md file)."""
    broken = []
    for target in links(page.read_text()):
        if not relative(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append((target, "no such file"))
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append((target, f"no heading with anchor #{anchor} in {resolved.name}"))
    return broken


def linked_files(page: Path) -> set:
    return {(page.parent / t.partition("#")[0]).resolve() for t in links(page.read_text()) if relative(t)}


def parser_flags() -> set:
    """Every --flag spelling train.py's parser accepts (--no- forms and aliases included), but --help."""
    return {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def flags_in_table(text: str) -> set:
    """The flags docs/flags.md lists: the code spans of its table rows' first cells."""
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    return {flag for row in rows for flag in re.findall(r"`(--[^`]+)`", row.split(" | ")[0])}


# --- the README -----------------------------------------------------------------------------------------------


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move a section to docs/"
    )


@pytest.mark.parametrize("command", TWO_COMMANDS, ids=["train", "tests"])
def test_readme_keeps_the_two_commands_verbatim(command):
    assert command in README.read_text().splitlines(), f"README.md lost its command line:\n{command}"


def test_the_front_door_fits_in_its_first_lines_without_dated_figures():
    """The README's first 40 lines hold both commands, what the job writes and the fast tier's command; the suite's
    dated timings live in docs/testing.md, where they can grow without burying the commands."""
    front = "\n".join(README.read_text().splitlines()[:FRONT_DOOR_LINES])
    for command in TWO_COMMANDS:
        assert command in front, f"README.md's first {FRONT_DOOR_LINES} lines lost:\n{command}"
    assert "runs/default/" in front and 'pytest -m "not slow"' in front
    assert not DATED.search(front), f"a dated figure in README.md's front door: {DATED.search(front).group()}"


def test_every_docs_page_is_linked_from_the_readme():
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ holds no page"
    unlinked = [p.name for p in pages if p.resolve() not in linked_files(README)]
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_link_checks_can_fail(tmp_path):
    """The checks above find what they are for: a missing file, a missing anchor; code is not a link."""
    (tmp_path / "b.md").write_text("# Only heading: `x`\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#only-heading-x) [gone](missing.md) [anchor](b.md#nope) [web](https://example.com)\n"
        "`[code](not-a-link.md)`\n\n```\n[fenced](nor-this.md)\n```\n"
    )
    assert broken_links(page) == [("missing.md", "no such file"), ("b.md#nope", "no heading with anchor #nope in b.md")]
    assert linked_files(page) == {(tmp_path / n).resolve() for n in ("b.md", "missing.md")}


# --- docs/flags.md --------------------------------------------------------------------------------------------


def test_flags_reference_is_up_to_date():
    assert FLAGS_MD.is_file(), "docs/flags.md is missing: run python scripts/flags_reference.py"
    assert FLAGS_MD.read_text() == flags_reference().render(), (
        "docs/flags.md is stale: run python scripts/flags_reference.py"
    )


def test_flags_reference_lists_every_flag_the_parser_accepts():
    accepted, listed = parser_flags(), flags_in_table(FLAGS_MD.read_text())
    assert "--deepspeed" in accepted and "--no-bf16" in accepted  # an alias and a --no- form are counted
    assert not accepted - listed, f"flags docs/flags.md does not list: {sorted(accepted - listed)}"
    assert not listed - accepted, (
        f"flags docs/flags.md lists that the parser does not take: {sorted(listed - accepted)}"
    )


def test_flags_reference_check_mode(tmp_path, capsys):
    generator, stale = flags_reference(), tmp_path / "flags.md"
    stale.write_text(generator.render().replace("--learning_rate", "--learning_rat"))
    assert generator.main(["--check"], path=stale) == 1
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "stale" in message, message
    assert generator.main([], path=stale) == 0  # rewritten
    assert generator.main(["--check"], path=stale) == 0
