"""Prompts stage: the iteration's slice of the dataset, chat-templated and tokenized."""
from __future__ import annotations

from rft_core.data.prompts import DatasetError, build_prompts, iteration_indices, load_task, refill_indices
from rft_core.models.loading import load_tokenizer
from rft_core.models.vl import vl_processor_or_none
from rft_core.stages.common import Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import PromptsInput, stage_program
from schemas import ShardRef
from schemas.columns import PROMPTS


@stage_program(PromptsInput)
def run(inp: PromptsInput) -> ShardRef:
    """Write the prompts of ``inp.iteration`` (1-based) to ``inp.out``; ``inp.attempt`` >= 1
    takes the dynamic-sampling refill stream instead of the main data order.

    Raises:
        DatasetError: bad task, bad row, or (overlong_prompts="error") an overlong prompt.
        ShardError: ``inp.out`` is committed with another config.
    """
    commit = stage_commit(inp)
    cfg, iteration, attempt, tokenizer_path = inp.data, inp.iteration, inp.attempt, inp.tokenizer_path

    def compute() -> ShardRef:
        with Timer() as t:
            ds = load_task(cfg.task, size=cfg.size, seed=cfg.seed, task_config=cfg.task_config)
            idx = (iteration_indices(iteration, per_iteration=cfg.prompts_per_iteration, size=cfg.size, seed=cfg.seed)
                   if attempt == 0 else
                   refill_indices(iteration, attempt, per_iteration=cfg.prompts_per_iteration, size=cfg.size, seed=cfg.seed))
            tok = load_tokenizer(tokenizer_path)
            processor = vl_processor_or_none(tokenizer_path)
            batch = build_prompts([(i, ds[i]) for i in idx], tok, data_source=cfg.task, system_prompt=cfg.system_prompt,
                                  max_prompt_tokens=cfg.max_prompt_tokens, overlong=cfg.overlong_prompts,
                                  processor=processor)
        if batch.table.num_rows == 0:
            raise DatasetError(f"iteration {iteration}: every prompt was longer than data.max_prompt_tokens={cfg.max_prompt_tokens}")
        summary = {"seconds": t.seconds, "skipped_overlong": len(batch.skipped_overlong),
                   "skipped_prompt_ids": batch.skipped_overlong, "dataset_indices": idx}
        return commit.write(batch.table, schema=PROMPTS, summary=summary)

    return reuse_or_compute(commit, compute)
