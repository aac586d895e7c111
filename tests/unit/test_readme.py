"""The README fits a screen and leads into docs/; every link it has arrives somewhere, and every page is in the site.

(`make docs` checks the site's own links and anchors strictly with MkDocs; this checks what MkDocs does not see,
without the docs extra installed.)
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc extension (and so MkDocs) makes it."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            out.add(slug(m.group(1)))
    return out


def test_the_readme_fits_a_screen_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text


def test_every_relative_link_of_the_readme_arrives() -> None:
    links = [t for t in LINK.findall(README.read_text()) if not re.match(r"^[a-z]+:", t)]
    assert any(t.startswith("docs/") for t in links)
    for target in links:
        path, _, frag = target.partition("#")
        dest = (REPO / path) if path else README
        assert dest.exists(), target
        if frag:
            assert frag in anchors(dest), target


def test_every_docs_page_is_in_the_site_navigation_and_the_readme_links_the_index() -> None:
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav
    assert "docs/index.md" in README.read_text()


def test_slug_is_the_anchor_mkdocs_makes() -> None:
    assert slug("The deletion gate (`stam deletion`)") == "the-deletion-gate-stam-deletion"
    assert slug("Limits (`schemas/limits.py`)") == "limits-schemaslimitspy"
    assert slug("How to add ...") == "how-to-add"
