#!/usr/bin/env python3
"""Check every relative link and anchor in README.md, CHANGELOG.md and docs/*.md.

A link ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` or an image
``![alt](path)`` must name a file or folder that exists, relative to the page; an anchor
must be the GitHub slug of a heading of the page it points into (lower case, punctuation
other than ``-`` and ``_`` dropped, spaces made hyphens, repeats numbered ``-1``, ``-2``).
Links to other sites (``http:``, ``https:``, ``mailto:``) and links inside code (fenced
blocks and inline backticks) are not checked.

    python3 ci/check_doc_links.py        # prints each broken link, exits 1 if any
    python3 ci/check_doc_links.py ROOT   # the same for another tree (README.md and docs/ under ROOT)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose links are checked."""
    found = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in found if p.exists()]


def prose(text: str) -> str:
    """The page with fenced code blocks emptied and inline code blanked out (lines kept,
    so that a link's text may span lines and its line number is still known)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return re.sub(r"`+[^`\n]*`+", lambda m: " " * len(m.group(0)), "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before numbering repeats)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown page."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(root: Path = ROOT) -> list[str]:
    """``page:line: target (why)`` for every broken relative link or anchor."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for page in pages(root):
        text = prose(page.read_text(encoding="utf-8"))
        for m in LINK.finditer(text):
            target, number = m.group(1), text.count("\n", 0, m.start()) + 1
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # another site, or mailto:
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
                continue
            if anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where} (an anchor into a file that is not markdown)")
                    continue
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{where} (no heading with this anchor in {dest.relative_to(root)})")
    return problems


def main() -> int:
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    problems = broken_links(root)
    for p in problems:
        print(p)
    print(f"check_doc_links: {len(pages(root))} pages, {len(problems)} broken link(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
