"""The README and docs/*.md are what a newcomer reads first: every relative link in them must
reach a file of the repository and, with a ``#fragment``, a heading of that file (GitHub's
anchors), and the README keeps the two commands a fresh machine needs at its top (issue #40)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "kernels" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")

pytestmark = pytest.mark.timeout(60)


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a bash block is no heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a file's headings make, with GitHub's ``-1``, ``-2`` for repeated ones."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(path.read_text()) for m in LINK.finditer(line)]


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("Token budget: back-pressure by work, not by job count") == \
        "token-budget-back-pressure-by-work-not-by-job-count"
    assert github_anchor("The overlapped engine core (`engine/overlap.py`)") == \
        "the-overlapped-engine-core-engineoverlappy"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z]+:", target):         # http(s):, mailto:: not ours to check offline
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading makes #{fragment}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_opens_with_the_two_commands_ci_runs():
    readme = (REPO / "README.md").read_text().splitlines()
    block = readme[readme.index("```bash") + 1:readme.index("```", readme.index("```bash") + 1)]
    assert block[0].startswith("make demo ") and block[1].startswith("make test ")
    assert readme.index("```bash") < 5, "the two commands come first"
    assert "make test" in (REPO / ".ci" / "run").read_text().splitlines()
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_readme_stays_short_and_the_figures_live_in_benchmarks_md():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 170, "the README is what a newcomer reads: keep it short"
    assert "| what | figure | target | command |" not in readme
    bench = (REPO / "docs" / "benchmarks.md").read_text()
    assert "| what | figure | target | command |" in bench
    assert "python -m benchmarks.engine --threads 2" in bench
