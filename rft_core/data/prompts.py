"""Prompt selection from reasoning-gym tasks: a seeded, deterministic data order.

Iteration i (1-based) takes global positions (i-1)*P .. i*P-1 of an endless stream; position k
lies in epoch k // size at slot k % size of that epoch's permutation (numpy PCG64 seeded with
(seed, epoch)). So which prompts an iteration sees depends only on (seed, size, P, i), never on
what ran before: a resumed run sees exactly the prompts an uninterrupted one would.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.columns import PROMPTS


class DatasetError(ValueError):
    """A dataset row or the dataset itself is unusable; the message names the row and field."""


REQUIRED_FIELDS = ("question", "answer")


@lru_cache(maxsize=8)
def _dataset(task: str, size: int, seed: int, task_config_json: str):
    import reasoning_gym

    kwargs = json.loads(task_config_json)
    if task == "vl_digits":  # built in: digit images (scikit-learn) for vision-language RL
        from rft_core.data.vision import DigitsDataset

        try:
            return DigitsDataset(size, seed, **kwargs)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"vl_digits dataset with size={size}, {kwargs}: {exc}") from exc
    if task == "humaneval":  # built in: code problems graded by the code_exec reward source
        from rft_core.data.humaneval import HumanEvalDataset

        try:
            return HumanEvalDataset(size, **kwargs)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"humaneval dataset with size={size}, {kwargs}: {exc}") from exc
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except Exception as exc:
        raise DatasetError(f"cannot create reasoning-gym dataset {task!r} with {kwargs}: {exc}") from exc


def load_task(task: str, *, size: int, seed: int, task_config: dict[str, Any] | None = None):
    """The reasoning-gym dataset object, or a built-in task: ``humaneval`` (HumanEval problems,
    ``rft_core.data.humaneval``) or ``vl_digits`` (digit images, ``rft_core.data.vision``);
    cached per arguments.

    Raises:
        DatasetError: unknown task or bad task_config.
    """
    return _dataset(task, size, seed, json.dumps(task_config or {}, sort_keys=True))


def iteration_indices(iteration: int, *, per_iteration: int, size: int, seed: int) -> list[int]:
    """Dataset indices used by ``iteration`` (1-based); see the module docstring."""
    if iteration < 1:
        raise ValueError(f"iterations are 1-based, got {iteration}")
    out = []
    cache: dict[int, np.ndarray] = {}
    for k in range((iteration - 1) * per_iteration, iteration * per_iteration):
        epoch, slot = divmod(k, size)
        if epoch not in cache:
            cache[epoch] = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(size)
        out.append(int(cache[epoch][slot]))
    return out


def refill_indices(iteration: int, attempt: int, *, per_iteration: int, size: int, seed: int) -> list[int]:
    """Dataset indices for dynamic-sampling refill ``attempt`` (>= 1) of ``iteration``: a stream
    separate from the main order (PCG64 seeded with (seed, 1, iteration, attempt)), so refills
    never shift which prompts later iterations get."""
    if attempt < 1:
        raise ValueError(f"refill attempts are numbered from 1, got {attempt}")
    rng = np.random.Generator(np.random.PCG64([seed, 1, iteration, attempt]))
    return [int(i) for i in rng.choice(size, size=min(per_iteration, size), replace=False)]


HELDOUT_SEED_OFFSET = 1_000_003  # default held-out seed: data.seed + data.size + this


def heldout_seed(*, train_seed: int, train_size: int, seed: int | None = None) -> int:
    """The dataset seed of the held-out split: ``seed`` if given, else
    ``train_seed + train_size + HELDOUT_SEED_OFFSET``.

    reasoning-gym builds entry ``idx`` from ``Random(seed + idx)``, so a dataset with seed s+1 is
    the training dataset shifted by one index; the default starts past every training stream.
    Disjointness itself is guaranteed by ``heldout_entries``' question-text filter, not by the seed.
    """
    return seed if seed is not None else train_seed + train_size + HELDOUT_SEED_OFFSET


def heldout_entries(task: str, *, num_prompts: int, train_size: int, train_seed: int, seed: int,
                    task_config: dict[str, Any] | None = None, pool_factor: int = 4) -> list[tuple[int, dict[str, Any]]]:
    """``num_prompts`` entries of ``task`` whose question texts occur nowhere in the training
    dataset (all ``train_size`` entries of ``train_seed``) and not twice among themselves.

    Candidates are the entries 0, 1, 2, ... of the dataset generated with ``seed``
    (``pool_factor * num_prompts + 64`` of them), taken in index order: the split depends only on
    the arguments.

    Returns:
        (index in the held-out dataset, entry) pairs, in index order.
    Raises:
        DatasetError: fewer than ``num_prompts`` disjoint, distinct questions among the
            candidates (the message gives the counts), or an unknown task / bad task_config.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    train = load_task(task, size=train_size, seed=train_seed, task_config=task_config)
    seen = {str(train[i]["question"]) for i in range(train_size)}
    pool = pool_factor * num_prompts + 64
    candidates = load_task(task, size=pool, seed=seed, task_config=task_config)
    out: list[tuple[int, dict[str, Any]]] = []
    dropped = 0
    for i in range(pool):
        entry = candidates[i]
        q = str(entry["question"])
        if q in seen:
            dropped += 1
            continue
        seen.add(q)
        out.append((i, entry))
        if len(out) == num_prompts:
            return out
    raise DatasetError(f"held-out split of {task!r} (seed {seed}): only {len(out)} of {pool} candidates are questions "
                       f"absent from the {train_size} training entries and not repeated ({dropped} dropped); "
                       f"asked for {num_prompts}. Lower eval.num_prompts or use a task with more distinct questions.")


@dataclass
class PromptBatch:
    """The prompts of one iteration as an Arrow table plus what was skipped."""

    table: pa.Table
    skipped_overlong: list[str] = field(default_factory=list)


def build_prompts(
    entries: list[tuple[int, dict[str, Any]]],
    tokenizer,
    *,
    data_source: str,
    system_prompt: str,
    max_prompt_tokens: int,
    overlong: str = "skip",
    id_prefix: str | None = None,
    processor=None,
) -> PromptBatch:
    """Render dataset entries with the chat template and tokenize them.

    Args:
        entries: (dataset index, entry) pairs; an entry needs ``question`` and ``answer`` and
            may have ``images`` (paths, file:// URLs, bytes or PIL images; stored as bytes).
        processor: a ``rft_core.models.vl.VLProcessor`` for a vision-language policy: the
            prompt gets one image placeholder per image, expanded to the image's token count.
        overlong: "skip" drops prompts longer than ``max_prompt_tokens`` and lists them in
            ``skipped_overlong``; "error" raises.
        id_prefix: prompt_id is ``{id_prefix}-{index:06d}`` (None: ``data_source``); the
            held-out split uses its own prefix so its ids never equal a training prompt's.
    Raises:
        DatasetError: an entry misses a required field, has images for a text-only policy or an
            unreadable image, or (overlong="error") a prompt is too long.
    """
    from rft_core.data.images import ImageError, to_image_bytes

    rows: dict[str, list] = {f.name: [] for f in PROMPTS.schema}
    skipped = []
    for index, entry in entries:
        missing = [f for f in REQUIRED_FIELDS if f not in entry or entry[f] is None]
        if missing:
            raise DatasetError(f"{data_source} row {index}: missing field(s) {missing}; a row needs {list(REQUIRED_FIELDS)}")
        prompt_id = f"{id_prefix or data_source}-{index:06d}"
        try:
            images = [to_image_bytes(img, where=f"{data_source} row {index} image {k}")
                      for k, img in enumerate(entry.get("images") or [])]
        except ImageError as exc:
            raise DatasetError(str(exc)) from exc
        if processor is not None:
            text = processor.render_prompt(str(entry["question"]), len(images), system_prompt)
            ids = processor.prompt_ids(text, images)
        elif images:
            raise DatasetError(f"{data_source} row {index} has {len(images)} image(s) but the policy is a text-only model")
        else:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": str(entry["question"])}
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            if overlong == "error":
                raise DatasetError(f"{prompt_id}: prompt has {len(ids)} tokens, data.max_prompt_tokens is {max_prompt_tokens}")
            skipped.append(prompt_id)
            continue
        rows["prompt_id"].append(prompt_id)
        rows["data_source"].append(data_source)
        rows["question"].append(str(entry["question"]))
        rows["prompt_text"].append(text)
        rows["prompt_token_ids"].append(ids)
        rows["answer"].append(str(entry["answer"]))
        rows["metadata_json"].append(json.dumps(entry.get("metadata", {}), default=str, sort_keys=True))
        rows["images"].append(images)
    return PromptBatch(pa.table(rows, schema=PROMPTS.arrow), skipped)
