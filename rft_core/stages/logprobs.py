"""Actor, reference and teacher log-prob stages: per-token log-probs of the rollout's responses."""
from __future__ import annotations

import pyarrow as pa

from rft_core.models.loading import pad_token_id
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.models.vl import vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.common import Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import ActorLogprobsInput, RefLogprobsInput, TeacherLogprobsInput, stage_program
from rft_core.stages.sources import config_folder, inference_model
from rft_core.stages.teacher import check_teacher_tokenizer
from rft_core.training.loop import pass_micro_batches
from rft_core.training.update import first_epoch_rows
from schemas import ShardRef, read_shard
from schemas.columns import ACTOR_LOGPROBS, REF_LOGPROBS, TEACHER_LOGPROBS

_SCHEMAS = {"actor_logprobs": (ACTOR_LOGPROBS, "old_logprobs"), "ref_logprobs": (REF_LOGPROBS, "ref_logprobs"),
            "teacher_logprobs": (TEACHER_LOGPROBS, "teacher_logprobs")}
_ROLES = {"actor_logprobs": "policy", "ref_logprobs": "reference", "teacher_logprobs": "teacher"}


@stage_program(ActorLogprobsInput, RefLogprobsInput, TeacherLogprobsInput)
def run(inp: ActorLogprobsInput | RefLogprobsInput | TeacherLogprobsInput) -> ShardRef:
    """Compute log-probs of every response token under ``inp.model``; write the column group of
    ``inp.stage``: ``actor_logprobs`` (the policy before the update: old_logprobs and
    action_entropy), ``ref_logprobs`` (the reference) or ``teacher_logprobs`` (on-policy
    distillation's teacher, whose tokenizer is first checked against the policy's,
    ``inp.tokenizer_path``: ``TeacherTokenizerError`` before anything is computed). Logits are
    divided by ``inp.temperature``, the rollout's sampling temperature (for the teacher
    ``TrainConfig.teacher_temperature``: the rollout's unless ``teacher.temperature`` is set);
    ``logprobs.chunk_size`` bounds the float32 (chunk, vocab) slices of the log-prob computation.
    The packed rows: ``_micro_batches`` (below float32 the update's, so that its first step computes these very
    log-probs; ``logprobs.max_tokens_per_micro_batch``: by tokens). A vision-language model gets each
    sample's images and videos (processor from the model folder), padded or packed
    (``logprobs.packing``). In a resident worker the model is the worker's copy
    (``rft_core.workers.memory.inference_model``). The model's GPU memory is handed
    back to the driver when the program returns (``run_in_process``: ``release_models``, not inside a resident worker
    that keeps its cache).

    ``with_sum_pi_squared`` (actor only): also the optional column ``sum_pi_squared``,
    list<float32> with one entry per response token like ``old_logprobs``: sum_v pi_old(v)^2 with
    pi_old = softmax(logits / temperature), computed in the same chunked pass
    (``token_logprobs``); the optimal token baseline's input. Without it the shard is exactly
    what it was before that column existed."""
    schema, column = _SCHEMAS[inp.stage]
    commit = stage_commit(inp)
    cfg, stage = inp.logprobs, inp.stage

    def compute() -> ShardRef:
        if isinstance(inp, TeacherLogprobsInput):  # its log-probs must be of the policy's token ids
            check_teacher_tokenizer(inp.tokenizer_path, config_folder(inp.model))
        table = read_shard(inp.rollout, stage="rollout")
        prompts, responses = table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist()
        groups = _micro_batches(inp, prompts, responses)  # a sample beyond the token budget: refused before the model
        path = config_folder(inp.model)
        pad_id = pad_token_id(path)
        actor = stage == "actor_logprobs"
        lm = inference_model(inp.model, dtype=inp.dtype, role=_ROLES[stage])
        processor = vl_processor_or_none(path)  # a vision-language policy: images and videos go with every batch
        vision = ({"images": table.column("images").to_pylist(), "videos": table.column("videos").to_pylist(),
                   "processor": processor} if processor is not None else {})
        spi2 = actor and bool(getattr(inp, "with_sum_pi_squared", False))
        with Timer() as t, progress_reporter(stage, unit="sequences") as progress:
            res = batched_response_logprobs(lm, prompts, responses, pad_token_id=pad_id,
                                            micro_batch_size=cfg.micro_batch_size, temperature=inp.temperature,
                                            with_entropy=actor,
                                            packing=cfg.packing if inp.grouping is None else inp.grouping.packing,
                                            progress=progress, chunk_size=cfg.chunk_size, groups=groups,
                                            with_sum_pi_squared=spi2, **vision)
        f32 = pa.list_(pa.float32())
        cols = {"sample_id": table.column("sample_id")}
        if actor:  # the policy's entropy at each token: for the entropy metrics and high-entropy filtering
            cols.update({column: pa.array(res[0], f32), "action_entropy": pa.array(res[1], f32)})
            if spi2:  # sum_v pi_old(v)^2 at each token: the optimal token baseline's input
                cols["sum_pi_squared"] = pa.array(res[2], f32)
        else:
            cols[column] = pa.array(res, f32)
        out_table = pa.table(cols, schema=schema.arrow_with(["sum_pi_squared"] if spi2 else []))
        summary = {"seconds": t.seconds}
        if actor:
            masks = table.column("action_mask").to_pylist()  # model tokens only (multi-turn: no observations)
            ents = [e for row, m in zip(res[1], masks) for e, k in zip(row, m) if k]
            summary["entropy_mean"] = sum(ents) / max(len(ents), 1)
        return commit.write(out_table, schema=schema, inputs={"rollout": inp.rollout}, summary=summary)

    return reuse_or_compute(commit, compute)


def _micro_batches(inp: ActorLogprobsInput | RefLogprobsInput | TeacherLogprobsInput, prompts: list[list[int]],
                   responses: list[list[int]]) -> list[list[int]] | None:
    """The pass's packed rows: below float32 (``inp.grouping``) the first-epoch micro-batches of
    the update that starts from policy version ``grouping.policy_version`` (``first_epoch_rows``),
    so that its first step computes these very log-probs; else with ``logprobs.max_tokens_per_micro_batch``
    rows of at most that many tokens (``pass_micro_batches``); else None (length-sorted rows of
    ``logprobs.micro_batch_size``, ``batched_response_logprobs``).

    Raises:
        ValueError: a sample longer than the token budget.
    """
    budget = inp.logprobs.max_tokens_per_micro_batch
    if inp.grouping is not None:
        return first_epoch_rows(inp.grouping, prompts, responses)
    if budget is None:
        return None
    return pass_micro_batches(prompts, responses, budget, key="logprobs.max_tokens_per_micro_batch")
