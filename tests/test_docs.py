"""The documentation (README.md and docs/*.md) against the repository: every list of the files to copy names the
installer's files, no text gives another count of them, every relative link reaches a file and heading that exist,
times and test counts of runs live in the one dated record (docs/run-history.md), and the smoke tier the docs promise
holds a golden case of every family. No model is built: it runs in every environment of the matrix, in well under a
second."""
import re
from pathlib import Path

import pytest

from chatglm_tools import CODE_FILES
from conftest import GLM4V_CASES, GOLDEN_CASES, SMOKE

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


# ---- one record of dated runs ----------------------------------------------------------------------------------
# How long a command ran and what it counted are stated in docs/run-history.md only (speed and memory: in
# docs/speed-and-memory.md, their own dated record); every other page and the scripts' headers point there, so no two
# places can give different numbers for the same run.
RECORDS = {"run-history.md", "speed-and-memory.md"}
TEST_COUNT = re.compile(r"\b\d+ passed\b")
MINUTES = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:min|minutes|hours?)\b|\b(?:half )?an hour\b")
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


def test_the_figure_checks_read_the_phrasings_the_pages_used():
    """The phrasings the pages gave before there was one record, and what is no run's figure."""
    assert MINUTES.search("19 min from a fresh clone") and MINUTES.search("about 5 minutes on 2 cores")
    assert MINUTES.search("first run 3-4 min") and MINUTES.search("in one lane 57 min")
    assert MINUTES.search("about half an hour for the llama.cpp build")
    assert TEST_COUNT.search("tests 16 min: 1227 passed, 3 skipped")
    assert not MINUTES.search("a few minutes") and not MINUTES.search("`matrix: N passed`")
    assert not TEST_COUNT.search("`matrix: N passed, N failed, N skipped`")


@pytest.mark.parametrize("page", [page for page in PAGES if page.name not in RECORDS] + SCRIPTS,
                         ids=lambda page: page.relative_to(REPO).as_posix())
def test_run_times_and_test_counts_are_stated_in_the_run_history_only(page):
    text = page.read_text(encoding="utf-8")
    if page.suffix == ".sh":  # the comments: a script's header and its notes
        text = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    found = MINUTES.findall(text) + TEST_COUNT.findall(text)
    assert not found, (f"{page.relative_to(REPO)} states {found}: a run's time or test count goes into "
                       "docs/run-history.md with its date, and this page points to it")


# ---- the smoke tier -----------------------------------------------------------------------------------------------
# README and docs/testing.md promise a golden case of the original code per family in `scripts/test.sh --smoke`.
# tests/conftest.py stops the collection of a module whose SMOKE entry names no test, so each name here is a test.
SMOKE_GOLDEN_CASE = {"GLM-4": "glm4-chat-tiny", "ChatGLM3": "chatglm3-tiny", "ChatGLM2": "chatglm2-tiny"}


def smoke_golden_tests(module, case=None):
    """SMOKE's golden tests of a module, of one golden case if named (its parameters start with the case's id)."""
    found = []
    for name in SMOKE.get(module, ()):
        function, _, parameters = name.partition("[")
        if "golden" in function and (case is None or parameters.rstrip("]") == case
                                     or parameters.startswith(case + "-")):
            found.append(name)
    return found


@pytest.mark.parametrize("family", list(SMOKE_GOLDEN_CASE) + ["GLM-4V"])
def test_the_smoke_tier_holds_a_golden_case_of_every_family(family):
    if family == "GLM-4V":
        assert set(GLM4V_CASES) and smoke_golden_tests("test_glm4v"), "SMOKE has no GLM-4V golden test"
        return
    case = SMOKE_GOLDEN_CASE[family]
    assert case in GOLDEN_CASES, f"{case} is no longer a golden case: SMOKE_GOLDEN_CASE names {family}'s"
    assert smoke_golden_tests("test_parity", case) + smoke_golden_tests("test_loading", case), (
        f"tests/conftest.py SMOKE has no golden test of {case} ({family})")
