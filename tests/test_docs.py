"""The docs hold together: every relative link and anchor resolves (ci/check_doc_links.py,
run as CI runs it: a command, not an import, so that tests/ and ci/ import nothing of each
other), the README keeps its budget (at most 150 lines, set-up and both commands in the
first 40), and bench/ holds exactly the results the pages cite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def broken_links(root: Path = ROOT) -> list[str]:
    """What ``python3 ci/check_doc_links.py ROOT`` prints: one broken link a line."""
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "check_doc_links.py"), str(root)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    problems = done.stdout.splitlines()
    assert (done.returncode == 1) == bool(problems), (done.returncode, done.stdout)
    return problems


def test_every_relative_link_and_anchor_resolves():
    assert broken_links() == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n[ok](docs/a.md#a-title---with-code) [gone](docs/none.md)\n"
        "[bad anchor](docs/a.md#nowhere) [a link over\ntwo lines](#top) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n[site](https://example.org/x)\n")
    (tmp_path / "docs" / "a.md").write_text("# A title (`--with code`)\n\n[up](../README.md#top)\n")
    problems = broken_links(tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("README.md:3: docs/none.md (no such file)")
    assert problems[1].startswith("README.md:4: docs/a.md#nowhere (no heading")


def test_the_readme_keeps_its_budget():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, len(lines)
    first = "\n".join(lines[:40])
    assert "bash ci/demo.sh" in first and "bash ci/test.sh" in first and "Set-up" in first


BENCH_CITATION = re.compile(r"bench/[A-Za-z0-9_./-]+\.(?:json|png|txt|log|csv)")
BENCH_LIMIT = 40


def bench_citations() -> dict[str, list[str]]:
    """Every ``bench/...`` result file the README or a page of docs/ names, with where."""
    found: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in BENCH_CITATION.finditer(line):
                found.setdefault(m.group(0), []).append(f"{page.relative_to(ROOT)}:{number}")
    return found


def test_bench_holds_only_cited_results_and_every_citation_exists():
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").rglob("*") if p.is_file()}
    files.discard("bench/README.md")
    cited = bench_citations()
    assert len(files) + 1 <= BENCH_LIMIT, len(files) + 1  # bench/README.md counts too
    assert sorted(files - set(cited)) == [], "in bench/ but cited by no page"
    assert {c: w for c, w in cited.items() if c not in files} == {}, "cited but not in bench/"
