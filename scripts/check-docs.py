#!/usr/bin/env python3
"""Checks the book's links after `mdbook build docs`, and the README's.

- Every chapter in docs/src is listed in SUMMARY.md (mdbook silently leaves others out).
- In every built chapter (docs/book/*.html): each relative href or src resolves, to a page of
  the book or to a file of the repository (the book links to configs, schemas and manifests),
  and each #fragment names an element id of its target page.
- In README.md: each relative link names an existing file, and each #fragment into the book's
  sources names one of that chapter's headings.

External (http/https/mailto) links are counted, not fetched: this machine reaches no web.
Exits 1 naming every broken link.
"""

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "docs" / "src"
BOOK = ROOT / "docs" / "book"


class Page(HTMLParser):
    """The links and element ids of one HTML page."""

    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value and tag in ("a", "img"):
                self.links.append(value)


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        cache[path] = page
    return cache[path]


def external(link):
    return urlsplit(link).scheme in ("http", "https", "mailto")


def heading_ids(md):
    """The ids mdbook gives a Markdown file's headings (its normalize_id)."""
    ids, fence = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else re.match(r"^#+ (.*)$", line)
        if m:
            text = m.group(1).strip().lower()
            ids.add("".join(c if c.isalnum() or c in "-_" else "-" if c == " " else "" for c in text))
    return ids


def main():
    problems, externals, checked = [], 0, 0
    summary = (SRC / "SUMMARY.md").read_text(encoding="utf-8")
    listed = {l.removeprefix("./") for l in re.findall(r"\]\(([^)#]+\.md)\)", summary)}
    for md in sorted(SRC.glob("*.md")):
        if md.name != "SUMMARY.md" and md.name not in listed:
            problems.append(f"docs/src/{md.name}: not listed in SUMMARY.md")
    if not BOOK.is_dir():
        sys.exit("docs/book is missing: run `mdbook build docs` first")

    for chapter in sorted(listed):
        html = BOOK / chapter.replace(".md", ".html")
        if not html.is_file():
            problems.append(f"{chapter}: built page {html.relative_to(ROOT)} is missing")
            continue
        for link in parse(html).links:
            if external(link):
                externals += 1
                continue
            checked += 1
            parts = urlsplit(link)
            target = (html.parent / unquote(parts.path)).resolve() if parts.path else html
            where = f"docs/src/{chapter}: link {link!r}"
            if not target.exists():
                problems.append(f"{where}: {target} does not exist")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in parse(target).ids:
                    problems.append(f"{where}: no id {parts.fragment!r} in {target.name}")

    readme = ROOT / "README.md"
    # Links in the README's prose (code blocks hold no links).
    prose = re.sub(r"^```.*?^```", "", readme.read_text(encoding="utf-8"), flags=re.S | re.M)
    for link in re.findall(r"\]\(([^)\s]+)\)", prose):
        if external(link):
            externals += 1
            continue
        checked += 1
        parts = urlsplit(link)
        target = (ROOT / unquote(parts.path)).resolve() if parts.path else readme
        if not target.exists():
            problems.append(f"README.md: link {link!r}: {target} does not exist")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in heading_ids(target):
            problems.append(f"README.md: link {link!r}: no heading {parts.fragment!r}")

    for p in problems:
        print(p)
    print(f"check-docs: {checked} links checked, {externals} external not fetched, "
          f"{len(problems)} broken")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
