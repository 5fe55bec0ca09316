"""Side tables (``write_shard(side_tables=...)``, issue 48: a partial rollout's ``carry/``): single
Parquet files committed under the shard's manifest, skipped by ``read_shard`` and read back by
``read_side_table`` with the checks a part gets."""
from __future__ import annotations

import pyarrow as pa
import pytest

from schemas import ShardSchemaError, read_manifest, read_shard, read_side_table, write_shard
from schemas.columns import PROMPTS, REF_LOGPROBS


def _ref_table(ids: list[str]) -> pa.Table:
    return pa.table({"sample_id": ids, "ref_logprobs": [[-1.0, -2.0]] * len(ids)}, schema=REF_LOGPROBS.arrow)


def test_a_side_table_is_committed_beside_the_parts_and_read_back(tmp_path):
    side = _ref_table(["c", "d", "e"])
    ref = write_shard(_ref_table(["a", "b"]), str(tmp_path / "s"), schema=REF_LOGPROBS, config_hash="h",
                      side_tables={"carry/x.parquet": (side, REF_LOGPROBS)})
    m, _ = read_manifest(ref.uri)
    assert {e.path: e.rows for e in m.files} == {"part-00000.parquet": 2, "carry/x.parquet": None} and m.num_rows == 2
    assert read_shard(ref).column("sample_id").to_pylist() == ["a", "b"]  # the parts only
    assert read_side_table(ref, "carry/x.parquet", REF_LOGPROBS).equals(side)
    with pytest.raises(ShardSchemaError, match="lists no side table 'carry/y.parquet'"):
        read_side_table(ref, "carry/y.parquet", REF_LOGPROBS)
    with pytest.raises(ShardSchemaError, match="expected 'prompts' version"):  # read as another stage's table
        read_side_table(ref, "carry/x.parquet", PROMPTS)


def test_a_bad_side_table_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="not a part's name"):
        write_shard(_ref_table(["a"]), str(tmp_path / "s"), schema=REF_LOGPROBS, config_hash="h",
                    side_tables={"part-00001.parquet": (_ref_table(["b"]), REF_LOGPROBS)})
    with pytest.raises(ShardSchemaError, match="missing column"):
        write_shard(_ref_table(["a"]), str(tmp_path / "t"), schema=REF_LOGPROBS, config_hash="h",
                    side_tables={"carry/p.parquet": (_ref_table(["b"]), PROMPTS)})
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()
