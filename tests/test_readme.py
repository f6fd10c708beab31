"""The README is the front page: its links lead to paths of the repository, and it stays a front page.

The docs site's strict build checks the links between docs/ pages; nothing else reads the README's.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown text that are paths (no URL, no bare anchor), anchors cut off."""
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_relative_links_are_read_with_anchors_cut_and_urls_left_out():
    text = "[a](docs/a.md#x) [b](https://x.org/b.md) [c](#top) [d](../e.md)"
    assert relative_links(text) == ["docs/a.md", "../e.md"]


def test_every_link_of_the_readme_leads_to_a_path_in_the_repository():
    links = relative_links(README.read_text())
    assert links, "the README links to its docs pages"
    broken = [t for t in links if not (README.parent / t).exists()]
    outside = [t for t in links if not (README.parent / t).resolve().is_relative_to(ROOT)]
    assert not broken, f"README links to nothing: {broken}"
    assert not outside, f"README links outside the repository: {outside}"


def test_the_readme_stays_a_front_page():
    # About 150 lines; details go to docs/, run-by-run timings to the lab notes.
    assert len(README.read_text().splitlines()) <= 180
