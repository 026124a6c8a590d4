"""The docs stay guides: each page under docs/ at most 15 KB, each design note at most 10 KB, every relative link
resolving to a file, and the product spoken of as a product (no talk of how the machines behind a number were
obtained)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
NOTES = sorted((ROOT / "docs" / "design").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES + NOTES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_size_and_links(page: Path) -> None:
    limit = 10 * 1024 if page.parent.name == "design" else 15 * 1024
    assert page.stat().st_size <= limit, f"{page.name}: {page.stat().st_size} bytes, more than {limit}"
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_no_talk_of_how_machines_were_obtained() -> None:
    pattern = re.compile(r"\b(lent|lend|lending|loaned|on loan)\b", re.IGNORECASE)
    files = [ROOT / "README.md", *PAGES, *NOTES, *sorted((ROOT / "sparsefuse").rglob("*.py"))]
    hits = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
