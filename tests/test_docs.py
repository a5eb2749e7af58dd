"""The README and the documents it points to: every relative link and image resolves, and
the README stays a front door (about three screens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|src=\"([^\"]+)\"")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    links = [a or b for a, b in LINK.findall(doc.read_text())]
    missing = [x for x in links if "://" not in x and not (doc.parent / x).exists()]
    assert not missing, f"{doc.name}: {missing}"


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.splitlines()[3:5] == [
        "make serve   # sets up .venv and serves the chat with the bundled model on http://127.0.0.1:8000",
        "make test    # sets up .venv and runs the whole test suite (CPU; GPU tests skip without CUDA)",
    ]
    assert len(text.splitlines()) <= 120
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(map(len, cells)) <= 160  # one-line cells
