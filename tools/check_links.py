"""Check that every relative link in README.md and docs/*.md resolves to a file or folder.

    python3 tools/check_links.py [FILE.md ...]     (default: README.md and every docs/*.md)

Prints each broken link as FILE:LINE: target, and exits 1 when there is one. Links with a scheme
(http:, https:, mailto:) and pure #anchors are skipped; a #anchor after a path is dropped.
"""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def broken(md: Path):
    in_code = False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).exists():
                yield n, target


def main(argv):
    files = [Path(a) for a in argv] or [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = 0
    checked = 0
    for md in files:
        for n, target in broken(md):
            shown = md.relative_to(REPO) if md.is_relative_to(REPO) else md
            print(f"{shown}:{n}: {target}")
            bad += 1
        checked += 1
    print(f"{checked} files checked, {bad} broken links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
