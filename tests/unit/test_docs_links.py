"""Every relative link in the README and docs/ names a file of the repository, and every anchor a heading of the
file it points into (headings as GitHub makes their anchors: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.*)$")


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        m = None if fenced else HEADING.match(line)
        if m:
            name = anchor(m.group(1))
            seen[name] = seen.get(name, -1) + 1
            found.add(name if not seen[name] else f"{name}-{seen[name]}")
    return found


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fenced ^= line.startswith("```")
        if not fenced:
            out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(doc: pathlib.Path) -> None:
    broken = []
    for number, target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{number}: {target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_a_broken_anchor_is_found(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# The driver's copy, parked\n\n[ok](#the-drivers-copy-parked) [bad](#the-drivers-copy)\n")
    assert anchors(doc) == {"the-drivers-copy-parked"}
    assert [t for _, t in links(doc)] == ["#the-drivers-copy-parked", "#the-drivers-copy"]
