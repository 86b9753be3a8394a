"""The documentation (README.md and docs/*.md) against the repository: every list of the files to copy names the
installer's files, no text gives another count of them, and every relative link reaches a file and heading that
exist. Standard library only: it runs in every environment of the matrix, in well under a second."""
import re
from pathlib import Path

import pytest

from chatglm_tools import CODE_FILES

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))

# A list of the files a user copies is marked in the markdown: <!-- code-files --> ... <!-- /code-files -->.
CODE_FILES_BLOCK = re.compile(r"<!-- code-files -->(.*?)<!-- /code-files -->", re.S)
FILE_NAME = re.compile(r"\b[a-z_]+\.py\b")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve")
# "five files", "the 5 code files", "five remote-code files": a count of the files to copy, spelled or in digits.
# "GLM-4 file" (a hyphen before the digit) is a name, not a count.
FILE_COUNT = re.compile(r"(?<![\w-])(" + "|".join(NUMBER_WORDS) + r"|\d+) (?:code |remote-code |python |\.py )?files\b",
                        re.I)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#*$", re.M)


def prose(text):
    """The text outside fenced code blocks (a `# comment` there is no heading, a `[x](y)` no link)."""
    return FENCE.sub("", text)


def github_anchor(heading):
    """GitHub's slug of a heading: lowercase, punctuation other than '-' and '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    """Every heading's anchor on a page, with GitHub's -1, -2 ... for a repeated one."""
    seen, found = {}, set()
    for match in HEADING.finditer(prose(page.read_text(encoding="utf-8"))):
        slug = github_anchor(match.group(2))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(page):
    """(target, anchor) of every link on a page that is not a web address."""
    for match in LINK.finditer(INLINE_CODE.sub("", prose(page.read_text(encoding="utf-8")))):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        yield (page if not path else (page.parent / path).resolve()), anchor


def test_github_anchor_follows_githubs_rule():
    """The slug rule the link check relies on, on headings of these pages."""
    assert github_anchor("GLM-4V (glm-4v-9b): images") == "glm-4v-glm-4v-9b-images"
    assert github_anchor("Export to transformers' own Glm (no remote code)") == "export-to-transformers-own-glm-no-remote-code"
    assert github_anchor("The NaN/inf weight check") == "the-naninf-weight-check"
    assert github_anchor("P-tuning v2 checkpoints (`pre_seq_len`)") == "p-tuning-v2-checkpoints-pre_seq_len"


def test_docs_pages_exist():
    assert len(PAGES) > 1, "docs/*.md: no page found"


def test_readme_lists_the_files_to_copy():
    assert CODE_FILES_BLOCK.search((REPO / "README.md").read_text(encoding="utf-8")), (
        "README.md has no <!-- code-files --> ... <!-- /code-files --> block naming the files to copy")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_each_list_of_the_files_to_copy_is_the_installers(page):
    """Each marked list names exactly tools/chatglm_tools' CODE_FILES, the files the installer copies."""
    for block in CODE_FILES_BLOCK.findall(page.read_text(encoding="utf-8")):
        named = set(FILE_NAME.findall(block))
        assert named == set(CODE_FILES), (
            f"{page.name}: a code-files block names {sorted(named)}; the installer copies {sorted(CODE_FILES)} "
            f"(missing {sorted(set(CODE_FILES) - named)}, extra {sorted(named - set(CODE_FILES))})")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_no_page_gives_another_count_of_the_files(page):
    right = {str(len(CODE_FILES)), NUMBER_WORDS[len(CODE_FILES)]}
    wrong = [match.group(0) for match in FILE_COUNT.finditer(page.read_text(encoding="utf-8"))
             if match.group(1).lower() not in right]
    assert not wrong, f"{page.name} says {wrong}: the installer copies {len(CODE_FILES)} files ({', '.join(CODE_FILES)})"


def test_the_count_check_catches_a_wrong_count():
    """The check above reads the phrasings the README used, and leaves a model name alone."""
    assert FILE_COUNT.search("copy the five files in").group(1) == "five"
    assert FILE_COUNT.search("the 5 code files").group(1) == "5"
    assert not FILE_COUNT.search("a GLM-4 files reader")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_relative_links_reach_a_file_and_heading(page):
    broken = []
    for target, anchor in relative_links(page):
        if not target.exists():
            broken.append(f"{target.relative_to(REPO) if target.is_relative_to(REPO) else target}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{target.relative_to(REPO)}#{anchor}: no such heading")
    assert not broken, f"{page.name}: broken links: {broken}"
