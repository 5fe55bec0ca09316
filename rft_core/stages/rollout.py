"""Rollout stage: sample a group of responses per prompt with the current policy."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rft_core.config import RolloutConfig
from rft_core.engines.hf import HFEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.progress import progress_reporter
from rft_core.stages.common import PolicyRef, Timer, policy_model_path, reuse_or_compute
from schemas import ShardRef, config_hash, read_shard, write_shard
from schemas.columns import ROLLOUT

SEED_STRIDE = 100_003  # iteration i samples with seed + i * stride: distinct, reproducible streams
ATTEMPT_STRIDE = 7_919  # dynamic-sampling refill attempts: another offset


def rollout_summary(table: pa.Table) -> dict[str, float]:
    """Mean response length (tokens) and the fraction cut at max_new_tokens, of a rollout table."""
    n = max(table.num_rows, 1)
    lengths = pc.list_value_length(table.column("response_token_ids")).to_pylist()
    return {"response_length_mean": sum(lengths) / n,
            "truncated_fraction": sum(f == "length" for f in table.column("finish_reason").to_pylist()) / n}


def run(prompts: ShardRef, policy: PolicyRef, cfg: RolloutConfig, *, iteration: int, out: str, dtype: str = "float32",
        attempt: int = 0) -> ShardRef:
    """Generate ``cfg.n_samples_per_prompt`` responses per prompt; write the rollout shard.

    sample_id = ``{prompt_id}#{k}`` with k the sample's index in its group. Dynamic-sampling
    refill ``attempt`` k samples with its own seed.
    """
    chash = config_hash("rollout", cfg, prompts, policy, iteration, dtype, *([attempt] if attempt else []))

    def compute() -> ShardRef:
        table = read_shard(prompts, stage="prompts")
        path = policy_model_path(policy)
        tok = load_tokenizer(path)
        model = load_causal_lm(path, dtype=dtype)
        engine = HFEngine(model, tok)
        prompt_ids = table.column("prompt_token_ids").to_pylist()
        with Timer() as t, progress_reporter("rollout", unit="sequences") as progress:
            gens = engine.generate(prompt_ids, n_samples_per_prompt=cfg.n_samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch_size,
                                   seed=cfg.seed + SEED_STRIDE * iteration + ATTEMPT_STRIDE * attempt,
                                   first_token_temperature=cfg.first_token_temperature, progress=progress)
        pids = table.column("prompt_id").to_pylist()
        rows = {
            "sample_id": [f"{pids[g.prompt_index]}#{g.sample_index}" for g in gens],
            "prompt_id": [pids[g.prompt_index] for g in gens],
            "sample_index": [g.sample_index for g in gens],
            "prompt_token_ids": [prompt_ids[g.prompt_index] for g in gens],
            "response_token_ids": [g.response_token_ids for g in gens],
            "response_text": tok.batch_decode([g.response_token_ids for g in gens], skip_special_tokens=True),
            "rollout_logprobs": [g.logprobs for g in gens],
            "action_mask": [[True] * len(g.response_token_ids) for g in gens],
            "finish_reason": [g.finish_reason for g in gens],
        }
        table_out = pa.table(rows, schema=ROLLOUT.arrow)
        n_tokens = sum(len(g.response_token_ids) for g in gens)
        summary = {"seconds": t.seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(t.seconds, 1e-9),
                   **rollout_summary(table_out)}
        return write_shard(table_out, out, schema=ROLLOUT, config_hash=chash, inputs={"prompts": prompts}, summary=summary)

    return reuse_or_compute("rollout", out, chash, compute)
