"""Every relative link of the README, docs/ and the RESULTS files points at a file that exists and, with ``#anchor``, at a heading.

A link ``[text](path#anchor)`` outside code (fenced blocks and inline code spans are skipped) must name an existing
file or folder relative to the linking file; ``#anchor`` (also alone: the same file) must equal the GitHub slug of
one of the target Markdown file's headings: the heading's text without its Markdown (links keep their text), lower
case, every character that is not a letter, digit, ``-``, ``_`` or space dropped, spaces as ``-``; the n-th repeat of
a slug gets ``-n``. Pure Python, no network: external links (``scheme:``) are not checked. Also: every
``docs/NAME.md`` the package's sources name (help texts, messages) exists.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _prose_lines(text: str):
  """(line number, line) of the lines outside fenced code blocks."""
  fenced = False
  for n, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      yield n, line


def slug(heading: str) -> str:
  """GitHub's anchor for a heading's text (before duplicate numbering)."""
  text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links: their text
  text = re.sub(r"<[^>]+>", "", text).strip().lower()
  text = "".join(c for c in text if c.isalnum() or c in "-_ ")
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """Every heading anchor of a Markdown file, duplicates numbered as GitHub does."""
  seen: dict[str, int] = {}
  out = set()
  for _, line in _prose_lines(path.read_text(encoding="utf-8")):
    m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    s = slug(m.group(1))
    n = seen.get(s, 0)
    seen[s] = n + 1
    out.add(s if n == 0 else f"{s}-{n}")
  return out


def broken_links(path: pathlib.Path) -> list[str]:
  """'file:line: target (why)' for each relative link of ``path`` that does not resolve."""
  problems = []
  for n, line in _prose_lines(path.read_text(encoding="utf-8")):
    for m in _LINK.finditer(_CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)):
      target = m.group(2)
      if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
        continue
      file_part, _, anchor = target.partition("#")
      dest = (path.parent / file_part).resolve() if file_part else path
      if not dest.exists():
        problems.append(f"{path.name}:{n}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        problems.append(f"{path.name}:{n}: {target} (no heading '#{anchor}' in {dest.name})")
  return problems


def _markdown_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
          ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "accuracy" / "RESULTS.md"]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
  assert broken_links(path) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
  (tmp_path / "a.md").write_text("# Title\n\n## The `x` key: what (it) does\n\n## Title\n", encoding="utf-8")
  (tmp_path / "b.md").write_text(
      "[ok](a.md#the-x-key-what-it-does) [dup](a.md#title-1) [self](#here) [ext](https://example.com/x.md)\n"
      "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n## Here\n"
      "[gone](missing.md) [bad](a.md#no-such-heading) [badself](#nowhere)\n", encoding="utf-8")
  assert broken_links(tmp_path / "b.md") == [
      "b.md:7: missing.md (no such file)",
      "b.md:7: a.md#no-such-heading (no heading '#no-such-heading' in a.md)",
      "b.md:7: #nowhere (no heading '#nowhere' in b.md)"]


def test_docs_named_by_the_package_exist():
  named = set()
  for src in (ROOT / "maxtext_nvfp4").rglob("*.py"):
    named |= set(re.findall(r"docs/([A-Za-z0-9_]+\.md)", src.read_text(encoding="utf-8")))
  assert named, "the package names no doc at all: the pattern is wrong"
  assert sorted(n for n in named if not (ROOT / "docs" / n).is_file()) == []


def test_every_config_key_has_a_row_in_the_usage_key_table():
  """docs/usage.md's key table names every ``nvfp4_*`` key the plugin adds to MaxText's config (core/settings.py)."""
  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  rows = {m.group(1) for m in re.finditer(r"^\| `(nvfp4_\w+)` \|", (ROOT / "docs" / "usage.md").read_text(), re.M)}
  missing = [k for k in settings.config_keys() if k not in rows]
  assert not missing, f"docs/usage.md has no key-table row for {missing}"
