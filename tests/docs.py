"""The project's documentation as tests read it: the README, the pages under docs/ and the other
markdown files a reader is sent to, and what their links and commands name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
# Every markdown file a user reads: the front page, docs/, and those beside the code they describe.
DOCUMENTS = [README, *PAGES, ROOT / "examples" / "README.md", ROOT / "bench" / "sim" / "CALIBRATION.md"]


def text() -> str:
    """The README and docs/ as one text, for a test that checks the docs say something."""
    return "\n".join(path.read_text() for path in [README, *PAGES])


LINK = re.compile(r"(?<!\\)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")


def links(path: Path) -> list[str]:
    """The targets of `path`'s markdown links, outside code."""
    prose = FENCE.sub("", path.read_text())
    prose = INLINE.sub("", prose)
    return LINK.findall(prose)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    plain = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of `path`'s headings (a repeated heading's later ones get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def commands(path: Path) -> list[str]:
    """Every `luftpause ...` command in `path`: in its code blocks and in its inline code, each cut
    at the first shell operator, from the word after `luftpause` on."""
    source = path.read_text()
    pieces = [line for block in FENCE.findall(source) for line in block.splitlines()]
    pieces += [code.replace("\n", " ") for code in INLINE.findall(FENCE.sub("", source))]
    found = []
    for piece in pieces:
        # The program itself: first in the line (after variables set for it), run by its path,
        # or after a shell operator; not `luftpause` as another program's argument.
        start = r"(?:^\s*(?:\$ )?(?:[A-Z_]+=\S* +)*|\S*/|(?:&&|\|\||[|;(]) *)"
        for m in re.finditer(start + r"luftpause((?: +[^\s|&;)`]+)*)", piece.split("#", 1)[0]):
            if m.group(1).strip():
                found.append(m.group(1).strip())
    return found
