"""The README and the docs pages: every relative link resolves (tools/check_links.py), and
docs/index.md lists every page under docs/."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    out = subprocess.run([sys.executable, str(REPO / "tools/check_links.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_docs_index_lists_every_page():
    index = (REPO / "docs/index.md").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md")
    assert [p for p in pages if f"]({p})" not in index] == []
    assert "](docs/index.md)" in (REPO / "README.md").read_text()


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
