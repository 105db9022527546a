"""The README is a front door and docs/ the library behind it: every relative link in README.md,
SECURITY.md and under docs/ leads to a file that exists, and to a heading there when it names one;
the README stays short, and a newcomer reaches what happens to a lost datagram from it in one
click."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# a code span may run over a line break, never over a blank line
CODE_SPAN = re.compile(r"`(?:[^`\n]|\n(?!\s*\n))*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages():
    return [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text, code_spans=False):
    """The page with fenced code blocks blanked, and code spans too unless asked to keep them (a
    heading's id keeps their text), line breaks kept. A link's text may run over a line break, so
    a page is searched whole."""
    lines, inside_fence = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside_fence = not inside_fence
            line = ""
        lines.append("" if inside_fence else line)
    text = "\n".join(lines)
    return text if code_spans else CODE_SPAN.sub(lambda span: "\n" * span.group().count("\n"), text)


def anchor(heading, seen):
    """The id GitHub gives a heading: lower case, punctuation dropped (letters, digits, '_' and '-'
    kept), spaces as '-', and '-1', '-2', ... after repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def anchors_of(path):
    seen = {}
    return {anchor(match.group(2), seen) for line in prose(path.read_text(), code_spans=True).split("\n")
            if (match := HEADING.match(line))}


def broken_links(path):
    """'file:line: target (why)' for every relative link of this page that leads nowhere."""
    broken = []
    text = prose(path.read_text())
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            continue
        number = text.count("\n", 0, match.start()) + 1
        file_part, _, fragment = target.partition("#")
        where = (path.parent / file_part).resolve() if file_part else path
        if not where.exists():
            broken.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such file)")
        elif fragment and where.suffix == ".md" and fragment not in anchors_of(where):
            broken.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such heading)")
    return broken


def test_every_relative_link_leads_somewhere():
    broken = [entry for page in pages() for entry in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_check_sees_a_broken_link_and_a_broken_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("# A page (`with` code)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-page-with-code) [ok](there.md#twice-1) [ok](#here)\n"
                    "## Here\n"
                    "[missing](nowhere.md) [bad anchor](there.md#elsewhere) `[in code](nowhere.md)`\n"
                    "```\n[in a fence](nowhere.md)\n```\n"
                    "a link whose text [runs over\na line break](gone.md), `a code span\n[over one](gone.md)`\n")
    assert broken_links(page) == ["page.md:3: nowhere.md (no such file)",
                                  "page.md:3: there.md#elsewhere (no such heading)",
                                  "page.md:7: gone.md (no such file)"]


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_readme_links_to_what_happens_when_a_datagram_is_lost():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/semantics.md#when-a-datagram-is-lost)" in readme
    assert "when-a-datagram-is-lost" in anchors_of(ROOT / "docs" / "semantics.md")
