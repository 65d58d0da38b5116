"""The README and docs/ hold together: every relative link reaches a file (and a heading, where it
names one), every `luftpause` command they show is one the CLI has, every config file they show
is one luftpause loads, and the front page stays a front page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from docs import DOCUMENTS, PAGES, README, ROOT, anchors, commands, links
from luftpause import config
from luftpause.cli import build_parser

# The front page: what it is, try it, connect a client, the headline figures, where to read on.
FRONT_PAGE_LINES = 250


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _choices(parser: argparse.ArgumentParser, dest: str) -> set[str]:
    return next(set(a.choices or ()) for a in parser._actions if a.dest == dest)


def _takes_value(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.option_strings and a.nargs != 0 for s in a.option_strings}


def unknown_command(words: list[str]) -> str | None:
    """What is wrong with `luftpause <words>`, or None: its subcommand, and for `bench` its
    benchmark, must be the CLI's; options before the subcommand are skipped with their values."""
    parser = build_parser()
    valued = _takes_value(parser)
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 1 if "=" in words[i] or words[i] not in valued else 2
    if i >= len(words):
        return None  # `luftpause --help`, or the name alone in prose
    subcommands = _subcommands(parser)
    if words[i] not in subcommands:
        return f"no subcommand {words[i]!r} (the CLI has {', '.join(sorted(subcommands))})"
    if words[i] == "bench" and i + 1 < len(words) and not words[i + 1].isupper():
        benches = _choices(subcommands["bench"], "scenario")
        if words[i + 1] not in benches:
            return f"no benchmark {words[i + 1]!r} (luftpause bench has {', '.join(sorted(benches))})"
    return None


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(path: Path) -> None:
    broken = []
    for target in links(path):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = unquote(target).partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            broken.append(
                f"{target}: no file {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}"
            )
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: {where.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_luftpause_command_shown_is_one_the_cli_has(path: Path) -> None:
    wrong = [f"`luftpause {c}`: {why}" for c in commands(path) if (why := unknown_command(c.split()))]
    assert not wrong, f"{path.relative_to(ROOT)}: " + "; ".join(wrong)


def test_the_checks_catch_a_wrong_command_and_a_broken_link(tmp_path: Path) -> None:
    assert unknown_command(["--log-format", "json", "up"]) is None
    assert unknown_command(["bench", "sim", "flood"]) is None
    assert "no subcommand 'stat'" in (unknown_command(["stat"]) or "")
    assert "no benchmark 'real-flood'" in (unknown_command(["bench", "real-flood"]) or "")
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nSee [it](page.md#a-page), [gone](gone.md) and `luftpause bench x`.\n")
    assert links(page) == ["page.md#a-page", "gone.md"]
    assert anchors(page) == {"a-page"}
    assert commands(page) == ["bench x"]


def test_the_readme_is_a_front_page_and_sends_the_reader_to_every_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= FRONT_PAGE_LINES, f"README.md is {lines} lines; move detail under docs/"
    named = {Path(t.partition("#")[0]).name for t in links(README)}
    assert {p.name for p in PAGES} <= named, "a page under docs/ the README never links"


def test_the_map_sends_a_newcomer_to_every_module_of_the_scheduler_and_the_dataplane() -> None:
    page = ROOT / "docs" / "where-things-live.md"
    named = {(page.parent / t.partition("#")[0]).resolve() for t in links(page)}
    modules = [p for part in ("scheduler", "dataplane") for p in sorted((ROOT / part).rglob("*.py"))]
    unnamed = [str(p.relative_to(ROOT)) for p in modules if p.name != "__init__.py" and p not in named]
    assert not unnamed, "docs/where-things-live.md never names " + ", ".join(unnamed)


TOML_FENCE = re.compile(r"^```toml\n(.*?)^```", re.S | re.M)


def test_every_config_file_shown_is_one_luftpause_loads(tmp_path: Path) -> None:
    shown = [(path, block) for path in DOCUMENTS for block in TOML_FENCE.findall(path.read_text())]
    assert shown, "docs/configuration.md shows a config file"
    for i, (path, block) in enumerate(shown):
        file = tmp_path / f"{i}.toml"
        file.write_text(block)
        try:
            config.load(file)
        except config.ConfigError as e:
            pytest.fail(f"the config shown in {path.relative_to(ROOT)} does not load: {e}")
