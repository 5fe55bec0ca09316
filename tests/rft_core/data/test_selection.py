"""Row selection: only the needed Parquet row groups are read; the data order is a pure function
of (seed, iteration); mixtures follow their weights within a binomial bound and resume exactly."""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.data import mixture, prompts
from rft_core.data.files import FileDataset
from rft_core.data.mixture import (
    MixtureDataset,
    mixture_indices,
    mixture_refill_indices,
    open_data,
)
from rft_core.data.readers import ParquetPart


def _parquet(path, n, *, row_group_size, prefix="q"):
    pq.write_table(pa.table({"question": [f"{prefix}{i}" for i in range(n)], "answer": [str(i) for i in range(n)]}),
                   path, row_group_size=row_group_size)
    return str(path)


def test_parquet_reads_only_the_row_groups_it_needs(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "big.parquet", 10_000, row_group_size=100)
    read: list[list[int]] = []
    orig = ParquetPart._iter

    def spy(self, row_groups, batch_rows):
        read.append(list(row_groups))
        return orig(self, row_groups, batch_rows)

    monkeypatch.setattr(ParquetPart, "_iter", spy)
    ds = FileDataset(path)
    assert len(ds) == 10_000 and read == []  # opening reads the footer only
    got = ds.entries([9_999, 0, 5_050, 0, 5_001])
    assert [(i, e["question"], e["answer"]) for i, e in got] == [
        (9_999, "q9999", "9999"), (0, "q0", "0"), (5_050, "q5050", "5050"), (0, "q0", "0"), (5_001, "q5001", "5001")]
    assert sorted(read) == [[0], [50], [99]]


def test_iteration_order_is_the_shared_seeded_stream_and_survives_reopening(tmp_path):
    path = _parquet(tmp_path / "d.parquet", 37, row_group_size=10)
    ds = open_data(path)
    for it in (1, 2, 9):
        idx = ds.iteration_indices(it, per_iteration=8, seed=11)
        assert idx == prompts.iteration_indices(it, per_iteration=8, size=37, seed=11)
        again = open_data(path)  # a resumed run opens the file afresh
        assert [e["question"] for _, e in again.entries(again.iteration_indices(it, per_iteration=8, seed=11))] == \
               [f"q{i}" for i in idx]
    first_epoch = [i for it in range(1, 6) for i in ds.iteration_indices(it, per_iteration=8, seed=11)][:37]
    assert sorted(first_epoch) == list(range(37))
    r = ds.refill_indices(2, 1, per_iteration=8, seed=11)
    assert r == prompts.refill_indices(2, 1, per_iteration=8, size=37, seed=11)


def test_mixture_counts_follow_weights_within_binomial_bound():
    sizes, weights, per, iters = [50, 7, 1000], [3, 1, 0.5], 8, 1500
    draws = [mixture_indices(it, per_iteration=per, sizes=sizes, weights=weights, seed=5) for it in range(1, iters + 1)]
    assert all(len(d) == per for d in draws)
    n = per * iters
    counts = np.bincount([s for d in draws for s, _ in d], minlength=3)
    for s, w in enumerate(weights):
        p = w / sum(weights)
        assert abs(counts[s] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (s, counts[s], n * p)
    # each source walks through all its rows before repeating one
    rows_of_1 = [r for d in draws for s, r in d if s == 1]
    for e in range(len(rows_of_1) // 7):
        assert sorted(rows_of_1[7 * e:7 * e + 7]) == list(range(7))
    assert all(0 <= r < sizes[s] for d in draws for s, r in d)
    # a resume (a fresh process: no cached running sums) computes iteration k alone and must get
    # exactly what the uninterrupted run got
    for k in (iters, 777, 2, 1):
        mixture._PREFIX_CACHE.clear()
        assert mixture_indices(k, per_iteration=per, sizes=sizes, weights=weights, seed=5) == draws[k - 1]
    assert mixture_indices(3, per_iteration=per, sizes=sizes, weights=weights, seed=6) != draws[2]


def test_mixture_refills_are_deterministic_and_apart():
    kw = {"per_iteration": 6, "sizes": [4, 100], "weights": [1, 1], "seed": 3}
    a = mixture_refill_indices(2, 1, **kw)
    assert a == mixture_refill_indices(2, 1, **kw) and a != mixture_refill_indices(2, 2, **kw)
    assert len(a) <= 6 and len(set(a)) == len(a)
    with pytest.raises(ValueError, match="numbered from 1"):
        mixture_refill_indices(2, 0, **kw)


def test_mixture_dataset_global_indices_and_labels(tmp_path):
    a = _parquet(tmp_path / "a.parquet", 5, row_group_size=2, prefix="a")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"b{i}", "answer": str(i), "data_source": "file_label"}) + "\n"
                                              for i in range(3)))
    ds = open_data(sources=[{"path": a, "weight": 3}, {"path": str(tmp_path / "b.jsonl"), "weight": 1, "data_source": "gsm8k"}])
    assert isinstance(ds, MixtureDataset) and len(ds) == 8 and ds.sizes == [5, 3]
    got = ds.entries([6, 0, 4])
    assert [(i, e["question"], e["data_source"]) for i, e in got] == [(6, "b1", "gsm8k"), (0, "a0", "a"), (4, "a4", "a")]
    assert got[0][1]["metadata"] == {"data_source": "file_label"}
    assert ds.where(6) == f"{tmp_path}/b.jsonl line 2 (row 1)"
    idx = ds.iteration_indices(4, per_iteration=8, seed=1)
    pairs = mixture_indices(4, per_iteration=8, sizes=[5, 3], weights=[3, 1], seed=1)
    assert idx == [s * 5 + r for s, r in pairs]
    assert [e["question"] for _, e in ds.entries(idx)] == [("a" if s == 0 else "b") + str(r) for s, r in pairs]
