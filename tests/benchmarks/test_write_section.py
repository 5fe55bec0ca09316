"""benchmarks/gpu_smoke.write_section, which the benchmarks' --doc options use: it rewrites one
section and keeps the rest of the file, and in a section holding the KEEP line it rewrites only
the text above that line (the reads of earlier runs, written by hand, stay)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_smoke(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("gpu_smoke", None)
    import gpu_smoke

    return gpu_smoke


def test_a_section_is_rewritten_up_to_its_kept_reads_and_the_rest_of_the_file_stays(tmp_path, monkeypatch):
    gs = _gpu_smoke(monkeypatch)
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n## One\n\nold table\n\n" + gs.KEEP + "\n\nread of 04:44\n\n## Two\n\ntwo\n")
    gs.write_section(doc, "One", "new table\n")
    assert doc.read_text() == "# B\n\n## One\n\nnew table\n\n" + gs.KEEP + "\n\nread of 04:44\n\n## Two\n\ntwo\n"
    gs.write_section(doc, "One", "newer table\n")  # again: the same shape, nothing doubled
    assert doc.read_text() == "# B\n\n## One\n\nnewer table\n\n" + gs.KEEP + "\n\nread of 04:44\n\n## Two\n\ntwo\n"


def test_without_the_kept_line_the_whole_section_is_rewritten_and_a_new_one_appended(tmp_path, monkeypatch):
    gs = _gpu_smoke(monkeypatch)
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n## One\n\nold table\n\nold read\n\n## Two\n\ntwo\n")
    gs.write_section(doc, "One", "new table\n")
    assert doc.read_text() == "# B\n\n## One\n\nnew table\n\n## Two\n\ntwo\n"
    gs.write_section(doc, "Two", "table\n\n" + gs.KEEP + "\n")  # the last section, kept line but nothing after it
    gs.write_section(doc, "Two", "table 2\n")
    assert doc.read_text() == "# B\n\n## One\n\nnew table\n\n## Two\n\ntable 2\n\n" + gs.KEEP + "\n"
    gs.write_section(doc, "Three", "three\n")
    assert doc.read_text().endswith(gs.KEEP + "\n\n## Three\n\nthree\n")
