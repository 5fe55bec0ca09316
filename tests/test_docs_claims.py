"""Every sentence of README.md and docs/*.md that claims "identical", "bit for bit",
"bit-identical" or "in CI" names the test that proves it, and that test exists (issue 39).

A sentence is a paragraph or list item split at sentence ends, or one table row; fenced code is
left out. It names a test by a path ``tests/....py`` (optionally ``::test_name``) or by a test
function's name (``test_...``); a path must exist, a ``::name`` must be defined in that file, a bare
name in some file under tests/. ``NOT_CLAIMS`` lists the few sentences that use the words without
claiming an equality or a CI run, each with the reason.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLAIM = re.compile(r"\bidentical\b|\bbit[- ]for[- ]bit\b|\bbit-identical\b|\bin CI\b", re.IGNORECASE)
TEST_PATH = re.compile(r"\btests/[\w/]+\.py(?:::(\w+))?")
TEST_NAME = re.compile(r"\btest_\w+")
# (file, words of the sentence) -> why it is no claim a test must prove
NOT_CLAIMS = {
    ("docs/task_probe.md", "fraction of groups with non-identical rewards"): "defines a column of the probe's table",
    ("docs/task_probe.md", "produce some identical prompts"): "describes the data set, no equality of two runs",
    ("docs/algorithms.md", "groups with identical task rewards got advantages"): "a measured property of the demo's rewards",
}


def _units(text: str) -> list[str]:
    """The sentences of a markdown text (see the module doc)."""
    units, block, fenced = [], [], False

    def flush():
        if block:
            para = " ".join(block)
            units.extend(s for s in re.split(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)(?<!vs\.)\s+(?=[A-Z*`(_\[])", para) if s.strip())
            block.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if stripped.startswith("|"):
            flush()
            units.append(stripped)
        elif not stripped or stripped.startswith(("#", "<!--")) or re.match(r"^([-*]|\d+\.)\s", stripped):
            flush()
            if stripped and not stripped.startswith(("#", "<!--")):
                block.append(stripped)
        else:
            block.append(stripped)
    flush()
    return units


def claims() -> list[tuple[str, str]]:
    """(file relative to the repository, sentence) of every claim sentence."""
    out = []
    for path in DOCS:
        rel = str(path.relative_to(ROOT))
        for unit in _units(path.read_text()):
            if CLAIM.search(unit) and not any(f == rel and words in unit for f, words in NOT_CLAIMS):
                out.append((rel, unit))
    return out


def _defined(name: str, files: list[Path]) -> bool:
    pattern = re.compile(rf"^\s*(async\s+)?def {re.escape(name)}\b", re.MULTILINE)
    return any(pattern.search(f.read_text()) for f in files)


def cited_tests(sentence: str) -> tuple[list[str], list[str]]:
    """(tests the sentence names that exist, those that do not)."""
    ok, missing = [], []
    for m in TEST_PATH.finditer(sentence):
        path = ROOT / m.group(0).split("::")[0]
        good = path.is_file() and (m.group(1) is None or _defined(m.group(1), [path]))
        (ok if good else missing).append(m.group(0))
    every_test_file = None
    for name in set(TEST_NAME.findall(TEST_PATH.sub("", sentence))):
        every_test_file = every_test_file or sorted((ROOT / "tests").rglob("*.py"))
        (ok if _defined(name, every_test_file) else missing).append(name)
    return ok, missing


def test_the_sentence_splitter_on_a_hand_made_page():
    page = ("# Title\n\nFirst sentence is identical. Second one (e.g. `tests/x.py`) too.\n- an item\n  wrapped here.\n"
            "```\nidentical in code\n```\n| a | identical |\n<!-- note -->\n")
    assert _units(page) == ["First sentence is identical.", "Second one (e.g. `tests/x.py`) too.", "- an item wrapped here.",
                            "| a | identical |"]


def test_a_claim_without_a_test_and_a_missing_test_are_caught():
    assert cited_tests("identical bit for bit") == ([], [])
    assert cited_tests("equal (`tests/test_docs_claims.py::test_no_such_test`)") == ([], [
        "tests/test_docs_claims.py::test_no_such_test"])
    assert cited_tests("see test_the_sentence_splitter_on_a_hand_made_page") == (
        ["test_the_sentence_splitter_on_a_hand_made_page"], [])
    assert cited_tests("in `tests/nowhere.py`") == ([], ["tests/nowhere.py"])


def test_the_docs_have_claims_to_check():
    assert len(claims()) >= 10, claims()  # the check is not vacuous: README and docs make such claims


@pytest.mark.parametrize("doc, sentence", claims(), ids=lambda v: v if v.endswith(".md") else v[:60])
def test_every_identical_bit_for_bit_or_in_ci_sentence_names_its_test(doc, sentence):
    ok, missing = cited_tests(sentence)
    assert not missing, f"{doc}: the sentence names tests that do not exist: {missing}\n  {sentence}"
    assert ok, f"{doc}: the sentence claims an equality or a CI run but names no test that proves it:\n  {sentence}"
