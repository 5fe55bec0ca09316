"""The dataset fingerprint changes when a file is edited, added or removed, and only then."""
from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from rft_core.data.files import FileDataset
from rft_core.data.mixture import data_fingerprint, open_data


def _write(path, answer):
    path.write_text(f'{{"question": "q", "answer": "{answer}"}}\n')


def test_local_edit_changes_it_and_untouched_keeps_it(tmp_path):
    p, other = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    _write(p, "1")
    _write(other, "1")
    fp = FileDataset(str(p)).fingerprint()
    fp_other = FileDataset(str(other)).fingerprint()
    assert fp.startswith(f"1f-{os.path.getsize(p)}B-")
    ds = FileDataset(str(p))
    ds.entries([0])  # reading, reopening and a permission change are not edits
    os.chmod(p, 0o600)
    assert FileDataset(str(p)).fingerprint() == fp
    (tmp_path / "moved").mkdir()
    shutil.copy2(p, tmp_path / "moved" / "d.jsonl")  # the same file elsewhere (mtime kept): the same fingerprint
    assert FileDataset(str(tmp_path / "moved" / "d.jsonl")).fingerprint() == fp
    before = os.stat(p)
    _write(p, "2")  # same size, other content
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))  # a later mtime even on coarse clocks
    assert os.path.getsize(p) == before.st_size
    assert FileDataset(str(p)).fingerprint() != fp
    assert FileDataset(str(other)).fingerprint() == fp_other


def test_memory_uri_edit(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/rft-fp/a.jsonl", b'{"question": "q", "answer": "1"}\n')
    fp = open_data("memory://rft-fp/a.jsonl").fingerprint()
    assert open_data("memory://rft-fp/a.jsonl").fingerprint() == fp
    fs.pipe("/rft-fp/a.jsonl", b'{"question": "q", "answer": "22"}\n')
    assert open_data("memory://rft-fp/a.jsonl").fingerprint() != fp


def test_folder_files_added_and_save_to_disk(tmp_path):
    import datasets

    (tmp_path / "f").mkdir()
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), tmp_path / "f" / "a.parquet")
    fp = open_data(str(tmp_path / "f")).fingerprint()
    assert fp.startswith("1f-")
    pq.write_table(pa.table({"question": ["b"], "answer": ["2"]}), tmp_path / "f" / "b.parquet")
    fp2 = open_data(str(tmp_path / "f")).fingerprint()
    assert fp2.startswith("2f-") and fp2 != fp
    assert open_data(str(tmp_path / "f" / "a.parquet")).fingerprint() == fp  # the same one file, however named
    datasets.Dataset.from_dict({"question": ["a"], "answer": ["1"]}).save_to_disk(str(tmp_path / "hf"))
    n_files = sum(len(files) for _, _, files in os.walk(tmp_path / "hf"))
    fp_hf = open_data(str(tmp_path / "hf")).fingerprint()
    assert fp_hf.startswith(f"{n_files}f-") and open_data(str(tmp_path / "hf")).fingerprint() == fp_hf
    datasets.Dataset.from_dict({"question": ["a"], "answer": ["9"]}).save_to_disk(str(tmp_path / "hf2"))
    os.replace(tmp_path / "hf", tmp_path / "hf_old")
    os.replace(tmp_path / "hf2", tmp_path / "hf")
    assert open_data(str(tmp_path / "hf")).fingerprint() != fp_hf
    sources = [{"path": str(tmp_path / "f")}, {"path": str(tmp_path / "hf")}]
    mixed = f"{fp2}+{open_data(str(tmp_path / 'hf')).fingerprint()}"
    assert open_data(sources=sources).fingerprint() == mixed
    assert data_fingerprint(sources=sources) == mixed and data_fingerprint(str(tmp_path / "f")) == fp2  # without reading
