"""The README stays a five-minute read and its links resolve (mkdocs checks the docs site's own
links with --strict; it does not read README.md or CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; the depth belongs in docs/ (issue 27)"


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_relative_links_resolve(name: str) -> None:
    text = (ROOT / name).read_text()
    targets = [t for t in LINK.findall(text) if "://" not in t and not t.startswith("#")]
    assert targets, f"{name} links nothing into the repository"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"{name} links to files that do not exist: {missing}"
