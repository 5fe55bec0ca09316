"""Prompts stage: the iteration's slice of the dataset, chat-templated and tokenized.

Two kinds of dataset (``data.source``): a generated reasoning-gym task (``load_task``), or the
user's files (``source: files``: ``rft_core.data.mixture.open_data``). For files, the dataset's
fingerprint (sizes and versions of its files, ``dataset_fingerprint``) is part of the stage's
config hash: a committed prompts stage made from other data is refused (``DatasetChangedError``,
naming the dataset), never reused.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import pyarrow as pa

from rft_core.data.mixture import dataset_fingerprint, open_data_config
from rft_core.data.prompts import DatasetError, PromptBatch, build_prompts, iteration_indices, load_task, refill_indices
from rft_core.models.loading import leased_tokenizer
from rft_core.models.vl import vl_processor_or_none
from rft_core.stages.common import Commit, Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import PromptsInput, stage_program
from rft_core.stages.partial import prompts_with_carry
from schemas import OlderVersionError, ShardRef, StaleShardError, read_manifest
from schemas.columns import PROMPTS

InputT = TypeVar("InputT", bound=Any)


class DatasetChangedError(StaleShardError):
    """A committed prompts stage was made from another version of the dataset's files."""


def with_fingerprint(inp: InputT, current: Callable[[], str | None]) -> InputT:
    """``inp`` with ``data_fingerprint`` filled by ``current()`` when the caller left it None
    (a program run by hand or from ``--config``), so the config hash always covers the data."""
    if inp.data_fingerprint is not None:
        return inp
    fp = current()
    return inp if fp is None else inp.model_copy(update={"data_fingerprint": fp})


def reuse_unless_data_changed(commit: Commit, compute: Callable[[], ShardRef], *, fingerprint: str | None,
                              dataset: str) -> ShardRef:
    """``reuse_or_compute``, with a committed stage of another config explained when its data
    fingerprint (``summary.data_fingerprint``) differs from ``fingerprint``.

    Raises:
        DatasetChangedError: the stage was committed from another version of ``dataset``.
        StaleShardError, OlderVersionError: as ``reuse_or_compute`` otherwise.
    """
    try:
        return reuse_or_compute(commit, compute)
    except OlderVersionError:
        raise
    except StaleShardError as exc:
        try:
            then = read_manifest(commit.uri)[0].summary.get("data_fingerprint")
        except Exception:  # unreadable manifest: the original error says enough
            raise exc from None
        if fingerprint is None or then is None or then == fingerprint:
            raise
        raise DatasetChangedError(
            f"{commit.uri}: the dataset {dataset} changed since this stage was committed (fingerprint {then} then, "
            f"{fingerprint} now: a file was edited, added, removed or rewritten). Committed results are never "
            "overwritten: restore the data to resume this run, or start a new run root.") from exc


def check_fingerprint(ds, expected: str | None, dataset: str) -> str:
    """The opened dataset's fingerprint.

    Raises:
        DatasetError: it is not ``expected`` (a file edited between the flow's look and this read).
    """
    now = ds.fingerprint()
    if expected is not None and now != expected:
        raise DatasetError(f"the dataset {dataset} changed while the stage ran (fingerprint {expected} when the run "
                           f"looked, {now} when read); rerun once the files stay put")
    return now


def dataset_label(data) -> str:
    """How messages name the ``data`` config's dataset: its path, or its sources' paths."""
    return repr(data.path) if data.path is not None else "mixture of " + ", ".join(repr(s.path) for s in data.sources)


def build_file_prompts(ds, entries: list[tuple[int, dict[str, Any]]], tokenizer, *, data, processor,
                       id_prefix: str | None = None) -> PromptBatch:
    """``build_prompts`` of file entries one by one, so a bad row's error names its file and row
    (``ds.where``); overlong prompts are skipped or refused as ``data.overlong_prompts`` says.

    Raises:
        DatasetError: as ``build_prompts``, prefixed with the row's file and row number.
    """
    tables, skipped = [], []
    for index, entry in entries:
        try:
            batch = build_prompts([(index, entry)], tokenizer, data_source=ds.name, system_prompt=data.system_prompt,
                                  max_prompt_tokens=data.max_prompt_tokens, overlong=data.overlong_prompts,
                                  id_prefix=id_prefix, processor=processor, prompt_template=data.prompt_template)
        except DatasetError as exc:
            raise DatasetError(f"{ds.where(index)}: {exc}") from exc
        tables.append(batch.table)
        skipped += batch.skipped_overlong
    return PromptBatch(pa.concat_tables(tables) if tables else PROMPTS.arrow.empty_table(), skipped)


def _file_prompts(inp: PromptsInput, tok, processor) -> tuple[PromptBatch, dict[str, Any]]:
    """The prompts of ``inp`` from the files of ``inp.data`` and what the summary records."""
    cfg = inp.data
    ds = open_data_config(cfg, require_answer=inp.answer_required)
    fingerprint = check_fingerprint(ds, inp.data_fingerprint, dataset_label(cfg))
    per, seed = cfg.prompts_per_iteration, cfg.seed
    idx = (ds.iteration_indices(inp.iteration, per_iteration=per, seed=seed) if inp.attempt == 0 else
           ds.refill_indices(inp.iteration, inp.attempt, per_iteration=per, seed=seed))
    entries = ds.entries(idx)  # every row checked before anything is written
    batch = build_file_prompts(ds, entries, tok, data=cfg, processor=processor)
    return batch, {"dataset_indices": idx, "rows": [ds.where(i) for i in idx], "dataset_rows": len(ds),
                   "data_fingerprint": fingerprint}


def _task_prompts(inp: PromptsInput, tok, processor) -> tuple[PromptBatch, dict[str, Any]]:
    """The prompts of ``inp`` from the reasoning-gym (or built-in) task of ``inp.data``."""
    cfg, iteration, attempt = inp.data, inp.iteration, inp.attempt
    ds = load_task(cfg.task, size=cfg.size, seed=cfg.seed, task_config=cfg.task_config)
    idx = (iteration_indices(iteration, per_iteration=cfg.prompts_per_iteration, size=cfg.size, seed=cfg.seed)
           if attempt == 0 else
           refill_indices(iteration, attempt, per_iteration=cfg.prompts_per_iteration, size=cfg.size, seed=cfg.seed))
    batch = build_prompts([(i, ds[i]) for i in idx], tok, data_source=cfg.task, system_prompt=cfg.system_prompt,
                          max_prompt_tokens=cfg.max_prompt_tokens, overlong=cfg.overlong_prompts, processor=processor,
                          prompt_template=cfg.prompt_template)
    return batch, {"dataset_indices": idx}


@stage_program(PromptsInput)
def run(inp: PromptsInput) -> ShardRef:
    """Write the prompts of ``inp.iteration`` (1-based) to ``inp.out``; ``inp.attempt`` >= 1
    takes the dynamic-sampling refill stream instead of the main data order. Which rows an
    iteration takes is a pure function of (data.seed, iteration, attempt) and the dataset's row
    count, so a resumed run gets exactly the same prompts.

    For ``data.source: files`` the summary records ``rows`` (``"{file} row {n}"`` of each
    selected row, in ``dataset_indices`` order), ``dataset_rows`` and ``data_fingerprint``.

    With ``inp.carry`` (``rollout.partial``: the previous iteration's rollout) the prompt rows of
    the groups it carries follow the iteration's own (``prompts_with_carry``; the summary's
    ``carried_prompts`` counts them), so the rewards stage finds the prompt of every row.

    Raises:
        DatasetError: bad task, unreadable files, a bad row (naming its file, row and column),
            or (overlong_prompts="error") an overlong prompt; raised before anything is written.
        DatasetChangedError: ``inp.out`` was committed from another version of the data files.
        StaleShardError: ``inp.out`` is committed with another config.
        ShardSchemaError: ``inp.carry`` is no partial rollout, or a carried group has a new prompt's id.
    """
    cfg = inp.data
    files = cfg.source == "files"
    if files:
        inp = with_fingerprint(inp, lambda: dataset_fingerprint(cfg))
    commit = stage_commit(inp)

    def compute() -> ShardRef:
        with Timer() as t, leased_tokenizer(inp.tokenizer_path) as tok:
            processor = vl_processor_or_none(inp.tokenizer_path)
            batch, extra = (_file_prompts if files else _task_prompts)(inp, tok, processor)
        if batch.table.num_rows == 0:
            raise DatasetError(f"iteration {inp.iteration}: every prompt was longer than "
                               f"data.max_prompt_tokens={cfg.max_prompt_tokens}")
        summary = {"seconds": t.seconds, "skipped_overlong": len(batch.skipped_overlong),
                   "skipped_prompt_ids": batch.skipped_overlong, **extra}
        if inp.carry is None:
            return commit.write(batch.table, schema=PROMPTS, summary=summary)
        table = prompts_with_carry(batch.table, inp.carry)  # rollout.partial: the carried groups' prompt rows after
        summary["carried_prompts"] = table.num_rows - batch.table.num_rows
        return commit.write(table, schema=PROMPTS, summary=summary, inputs={"carry": inp.carry})

    if not files:
        return reuse_or_compute(commit, compute)
    return reuse_unless_data_changed(commit, compute, fingerprint=inp.data_fingerprint, dataset=dataset_label(cfg))
