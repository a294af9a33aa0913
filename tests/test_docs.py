"""The documentation's links, and paths that leave the repository.

Every relative link in every Markdown file (README.md, docs/, bench/**) must name a file or
folder that exists, and a `#fragment` must name a heading of the file it points at, slugged as
GitHub slugs headings. No tracked text file may refer to a path outside the repository: the
sibling `shared` folder some checkouts have beside them, or an absolute path on the machine the
repository was written on. Standard library only: no JAX, a second or two.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", r"(?<![\w.~-])/" + "work/"]))

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _git_files(*args: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _markdown_files() -> list[Path]:
    files = _git_files("--cached", "--others", "--exclude-standard", "--", "*.md")
    return sorted(path for path in set(files) if path.is_file())


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _CODE_SPAN.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: dict[str, int] = {}
    names = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = found.get(base, 0)
        found[base] = count + 1
        names.add(base if count == 0 else f"{base}-{count}")
    return names


def test_slug_follows_github() -> None:
    assert slug("Several choices: n and best_of") == "several-choices-n-and-best_of"
    assert slug("Against llama.cpp") == "against-llamacpp"
    assert slug("`cadence-serve` flags") == "cadence-serve-flags"
    assert slug("Policies: chunked prefill against prefill-first") == (
        "policies-chunked-prefill-against-prefill-first")


def test_relative_links_resolve() -> None:
    files = _markdown_files()
    assert (ROOT / "README.md") in files
    dead = []
    cache: dict[Path, set[str]] = {}
    for md in files:
        for number, line in _prose_lines(md.read_text(encoding="utf-8")):
            for target in _LINK.findall(line):
                if _SCHEME.match(target) or target.startswith("//"):
                    continue  # a URL: not checked offline
                where = f"{md.relative_to(ROOT)}:{number}: {target}"
                path_part, _, fragment = target.partition("#")
                dest = (md.parent / path_part).resolve() if path_part else md
                if ROOT not in dest.parents and dest != ROOT:
                    dead.append(f"{where} (outside the repository)")
                    continue
                if not dest.exists():
                    dead.append(f"{where} (no such file)")
                    continue
                if fragment and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if fragment.lower() not in cache[dest]:
                        dead.append(f"{where} (no heading #{fragment})")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_nothing_refers_outside_the_repository() -> None:
    hits = []
    for path in _git_files("--cached"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)
