"""Actor and reference log-prob stages: per-token log-probs of the rollout's responses."""
from __future__ import annotations

import pyarrow as pa

from rft_core.config import LogprobConfig
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs, default_device
from rft_core.models.vl import vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.common import PolicyRef, Timer, policy_model_path, reuse_or_compute
from schemas import ShardRef, config_hash, read_shard, write_shard
from schemas.columns import ACTOR_LOGPROBS, REF_LOGPROBS

_SCHEMAS = {"actor_logprobs": (ACTOR_LOGPROBS, "old_logprobs"), "ref_logprobs": (REF_LOGPROBS, "ref_logprobs")}


def run(rollout: ShardRef, model: PolicyRef, cfg: LogprobConfig, *, stage: str, temperature: float, out: str,
        dtype: str = "float32") -> ShardRef:
    """Compute log-probs of every response token under ``model``; write ``stage``'s column group.

    Args:
        stage: "actor_logprobs" (the policy before the update -> old_logprobs) or
            "ref_logprobs" (the reference -> ref_logprobs).
        temperature: the rollout's sampling temperature (logits are divided by it).
    Raises:
        KeyError: unknown ``stage``.
    """
    if stage not in _SCHEMAS:
        raise KeyError(f"log-prob stage must be one of {sorted(_SCHEMAS)}, got {stage!r}")
    schema, column = _SCHEMAS[stage]
    chash = config_hash(stage, cfg.micro_batch_size, rollout, model, temperature, dtype, *(["packing"] if cfg.packing else []))

    def compute() -> ShardRef:
        table = read_shard(rollout, stage="rollout")
        path = policy_model_path(model)
        tok = load_tokenizer(path)
        lm = load_causal_lm(path, dtype=dtype).to(default_device())
        actor = stage == "actor_logprobs"
        images = table.column("images").to_pylist()
        processor = vl_processor_or_none(path)  # a vision-language policy: images go with every batch
        vision = {"images": images, "processor": processor} if processor is not None else {}
        with Timer() as t, progress_reporter(stage, unit="sequences") as progress:
            res = batched_response_logprobs(lm, table.column("prompt_token_ids").to_pylist(),
                                            table.column("response_token_ids").to_pylist(), pad_token_id=tok.pad_token_id,
                                            micro_batch_size=cfg.micro_batch_size, temperature=temperature,
                                            with_entropy=actor, packing=cfg.packing, progress=progress, **vision)
        f32 = pa.list_(pa.float32())
        cols = {"sample_id": table.column("sample_id")}
        if actor:  # the policy's entropy at each token: for the entropy metrics and high-entropy filtering
            cols.update({column: pa.array(res[0], f32), "action_entropy": pa.array(res[1], f32)})
        else:
            cols[column] = pa.array(res, f32)
        out_table = pa.table(cols, schema=schema.arrow)
        summary = {"seconds": t.seconds}
        if actor:
            ents = [e for row in res[1] for e in row]
            summary["entropy_mean"] = sum(ents) / max(len(ents), 1)
        return write_shard(out_table, out, schema=schema, config_hash=chash, inputs={"rollout": rollout}, summary=summary)

    return reuse_or_compute(stage, out, chash, compute)
