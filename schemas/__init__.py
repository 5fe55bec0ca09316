"""Arrow schemas of every stage's column group, the shard contract, and Experience conversion.

Never imports prefect.
"""
from schemas.columns import STAGE_SCHEMAS, StageSchema, schema_for
from schemas.layout import iteration_uri, stage_uri
from schemas.shards import (
    Manifest,
    OlderVersionError,
    PolicyRef,
    ShardCorruptError,
    ShardError,
    ShardNotCommittedError,
    ShardRef,
    ShardSchemaError,
    StaleShardError,
    atomic_put,
    commit_files,
    committed_ref,
    config_hash,
    filesystem,
    local_path,
    prepare_stage_dir,
    prune_files,
    pruned_files,
    read_manifest,
    sha256_file,
)
from schemas.tables import read_shard, validate_table, write_parts, write_shard

__all__ = [
    "STAGE_SCHEMAS",
    "Manifest",
    "OlderVersionError",
    "PolicyRef",
    "ShardCorruptError",
    "ShardError",
    "ShardNotCommittedError",
    "ShardRef",
    "ShardSchemaError",
    "StaleShardError",
    "StageSchema",
    "atomic_put",
    "commit_files",
    "committed_ref",
    "config_hash",
    "filesystem",
    "iteration_uri",
    "local_path",
    "prepare_stage_dir",
    "prune_files",
    "pruned_files",
    "read_manifest",
    "read_shard",
    "schema_for",
    "sha256_file",
    "stage_uri",
    "validate_table",
    "write_parts",
    "write_shard",
]
