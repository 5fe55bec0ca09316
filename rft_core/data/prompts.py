"""Prompt selection (reasoning-gym tasks, built-in tasks, users' files) and prompt rendering.

Iteration i (1-based) takes global positions (i-1)*P .. i*P-1 of an endless stream; position k
lies in epoch k // size at slot k % size of that epoch's permutation (numpy PCG64 seeded with
(seed, epoch)). So which prompts an iteration sees depends only on (seed, size, P, i), never on
what ran before: a resumed run sees exactly the prompts an uninterrupted one would.
``stream_indices`` is that stream for any key; mixtures of files (``rft_core.data.mixture``)
give each source its own keyed stream.

``build_prompts`` turns entries into the prompts table. An entry is a dict with ``question`` and
``answer`` (required), and optionally ``messages`` (the prompt as chat messages, rendered as
given), ``data_source`` (the row's reward-recipe label), ``metadata`` (JSON-serialisable),
``images`` and ``videos``. Users' files become entries in ``rft_core.data.files``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from rft_core.data.humaneval import HumanEvalDataset
from rft_core.data.images import ImageError, to_image_bytes
from rft_core.data.video import VideoError, to_video_bytes
from rft_core.data.vision import DigitsDataset, VideoDigitsDataset
from rft_core.models.vl import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from schemas.columns import PROMPTS


class DatasetError(ValueError):
    """A dataset row or the dataset itself is unusable; the message names the row and field."""


REQUIRED_FIELDS = ("question", "answer")


@lru_cache(maxsize=8)
def _dataset(task: str, size: int, seed: int, task_config_json: str):
    import reasoning_gym

    kwargs = json.loads(task_config_json)
    if task in ("vl_digits", "vl_video_digits"):  # built in: digit images / moving-digit clips for vision-language RL
        try:
            return (DigitsDataset if task == "vl_digits" else VideoDigitsDataset)(size, seed, **kwargs)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"{task} dataset with size={size}, {kwargs}: {exc}") from exc
    if task == "humaneval":  # built in: code problems graded by the code_exec reward source
        try:
            return HumanEvalDataset(size, **kwargs)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"humaneval dataset with size={size}, {kwargs}: {exc}") from exc
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except Exception as exc:
        raise DatasetError(f"cannot create reasoning-gym dataset {task!r} with {kwargs}: {exc}") from exc


def is_reasoning_gym_dataset(label: str) -> bool:
    """Whether ``label`` names a reasoning-gym dataset (the ``dataset`` grader scores with it)."""
    from reasoning_gym.factory import DATASETS

    return label in DATASETS


def load_task(task: str, *, size: int, seed: int, task_config: dict[str, Any] | None = None):
    """The reasoning-gym dataset object, or a built-in task: ``humaneval`` (HumanEval problems,
    ``rft_core.data.humaneval``), ``vl_digits`` (digit images) or ``vl_video_digits`` (clips of
    a digit moving across the frame; both ``rft_core.data.vision``); cached per arguments.

    Raises:
        DatasetError: unknown task or bad task_config.
    """
    return _dataset(task, size, seed, json.dumps(task_config or {}, sort_keys=True))


def stream_indices(start: int, count: int, *, size: int, key: Sequence[int]) -> list[int]:
    """Positions ``start .. start+count-1`` of the endless epoch-permuted stream of ``key``.

    Position k is slot ``k % size`` of the permutation of ``range(size)`` drawn by numpy PCG64
    seeded with ``[*key, k // size]``: every index once per epoch, a new order each epoch.
    ``iteration_indices`` is this stream with ``key = (seed,)``.

    Raises:
        ValueError: ``size`` < 1, or ``start``/``count`` negative.
    """
    if size < 1 or start < 0 or count < 0:
        raise ValueError(f"stream_indices needs size >= 1, start >= 0, count >= 0; got {size}, {start}, {count}")
    out = []
    cache: dict[int, np.ndarray] = {}
    for k in range(start, start + count):
        epoch, slot = divmod(k, size)
        if epoch not in cache:
            cache[epoch] = np.random.Generator(np.random.PCG64([*key, epoch])).permutation(size)
        out.append(int(cache[epoch][slot]))
    return out


def iteration_indices(iteration: int, *, per_iteration: int, size: int, seed: int) -> list[int]:
    """Dataset indices used by ``iteration`` (1-based); see the module docstring."""
    if iteration < 1:
        raise ValueError(f"iterations are 1-based, got {iteration}")
    return stream_indices((iteration - 1) * per_iteration, per_iteration, size=size, key=(seed,))


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
    """``num_prompts`` entries of ``task`` whose prompts occur nowhere in the training dataset
    (all ``train_size`` entries of ``train_seed``) and not twice among themselves. A prompt is
    its question text plus its images and videos (``prompt_key``): the vision tasks ask one
    question about many pictures, so for them the media tell prompts apart.

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
    seen = {prompt_key(train[i]) for i in range(train_size)}
    pool = pool_factor * num_prompts + 64
    candidates = load_task(task, size=pool, seed=seed, task_config=task_config)
    out: list[tuple[int, dict[str, Any]]] = []
    dropped = 0
    for i in range(pool):
        entry = candidates[i]
        q = prompt_key(entry)
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


def prompt_key(entry: dict[str, Any]) -> tuple[str, ...]:
    """What makes a dataset entry's prompt distinct: its question text, then one sha256 (hex)
    per image and per video, tagged by kind (``"image:<hex>"``, ``"video:<hex>"``), in order.
    Bytes are hashed as they are; a path or URL by its text; a PIL image by its mode, size and
    pixels. A text-only entry's key is ``(question,)``."""
    import hashlib

    def digest(item: Any) -> str:
        if isinstance(item, (bytes, bytearray, memoryview)):
            data = bytes(item)
        elif hasattr(item, "tobytes") and hasattr(item, "size") and hasattr(item, "mode"):  # a PIL image
            data = f"{item.mode}{item.size}".encode() + item.tobytes()
        else:
            data = str(item).encode()
        return hashlib.sha256(data).hexdigest()

    media = [f"{kind}:{digest(x)}" for kind in ("image", "video") for x in (entry.get(f"{kind}s") or [])]
    return (str(entry["question"]), *media)


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
    prompt_template: str | None = None,
) -> PromptBatch:
    """Render dataset entries as the policy sees them and tokenize them into the prompts table.

    Rendering (``render_prompt``): an entry with ``messages`` goes through the tokenizer's chat
    template exactly as given (its own system and few-shot turns; ``system_prompt`` is not
    added); a plain ``question`` gets ``system_prompt`` and the chat template, or
    ``prompt_template`` when one is given (for a tokenizer without a chat template).

    Args:
        entries: (dataset index, entry) pairs; an entry needs ``question`` and ``answer`` and
            may have ``messages`` (list of {role, content: str}), ``data_source`` (the row's
            label, else the ``data_source`` argument), ``metadata`` (dict, stored as JSON),
            ``images`` (paths, file:// URLs, bytes or PIL images; stored as bytes) and
            ``videos`` (paths, file:// URLs or bytes; ``rft_core.data.video.to_video_bytes``).
        processor: a ``rft_core.models.vl.VLProcessor`` for a vision-language policy: the
            prompt gets one placeholder per image / video, expanded to its token count.
        overlong: "skip" drops prompts longer than ``max_prompt_tokens`` and lists them in
            ``skipped_overlong``; "error" raises.
        id_prefix: prompt_id is ``{id_prefix}-{index:06d}`` (None: ``data_source``); the
            held-out split uses its own prefix so its ids never equal a training prompt's.
        prompt_template: a ``str.format`` template with ``{prompt}`` (and optionally
            ``{system_prompt}``), e.g. ``"Question: {prompt}\\nAnswer:"``; tokenized with the
            tokenizer's special tokens (BOS), no chat template.
    Raises:
        DatasetError: an entry misses a required field, has bad messages, images or videos for a
            text-only policy, an unreadable image, an unreadable / truncated / frameless video
            (named ``{data_source} row {index} video k``), a tokenizer with neither a chat
            template nor ``prompt_template``, or (overlong="error") a prompt is too long.
    """
    rows: dict[str, list] = {f.name: [] for f in PROMPTS.schema}
    skipped = []
    for index, entry in entries:
        missing = [f for f in REQUIRED_FIELDS if f not in entry or entry[f] is None]
        if missing:
            raise DatasetError(f"{data_source} row {index}: missing field(s) {missing}; a row needs {list(REQUIRED_FIELDS)}")
        prompt_id = f"{id_prefix or data_source}-{index:06d}"
        where = f"{data_source} row {index}"
        images, videos = _media_bytes(entry, where)
        text, ids = render_prompt(entry, tokenizer, system_prompt=system_prompt, prompt_template=prompt_template,
                                  processor=processor, images=images, videos=videos, where=where)
        if len(ids) > max_prompt_tokens:
            if overlong == "error":
                raise DatasetError(f"{prompt_id}: prompt has {len(ids)} tokens, data.max_prompt_tokens is {max_prompt_tokens}")
            skipped.append(prompt_id)
            continue
        rows["prompt_id"].append(prompt_id)
        rows["data_source"].append(str(entry.get("data_source") or data_source))
        rows["question"].append(str(entry["question"]))
        rows["prompt_text"].append(text)
        rows["prompt_token_ids"].append(ids)
        rows["answer"].append(str(entry["answer"]))
        rows["metadata_json"].append(json.dumps(entry.get("metadata", {}), default=str, sort_keys=True))
        rows["images"].append(images)
        rows["videos"].append(videos)
    return PromptBatch(pa.table(rows, schema=PROMPTS.arrow), skipped)


def _media_bytes(entry: dict[str, Any], where: str) -> tuple[list[bytes], list[bytes]]:
    """The entry's images and videos as checked, encoded bytes (``to_image_bytes`` /
    ``to_video_bytes``: every video decoded once, so an unreadable, truncated or frameless one
    fails here, named ``{where} video k``, before anything is committed)."""
    def named(item: Any) -> str:  # a path or URL is named in the error too
        return f" ({item})" if isinstance(item, (str, Path)) else ""

    try:
        images = [to_image_bytes(img, where=f"{where} image {k}{named(img)}")
                  for k, img in enumerate(entry.get("images") or [])]
    except ImageError as exc:
        raise DatasetError(str(exc)) from exc
    videos_in = entry.get("videos") or []
    if not videos_in:
        return images, []
    try:
        return images, [to_video_bytes(v, where=f"{where} video {k}{named(v)}") for k, v in enumerate(videos_in)]
    except VideoError as exc:
        raise DatasetError(str(exc)) from exc


def render_prompt(entry: dict[str, Any], tokenizer, *, system_prompt: str, prompt_template: str | None = None,
                  processor=None, images: Sequence[bytes] = (), videos: Sequence[bytes] = (),
                  where: str = "entry") -> tuple[str, list[int]]:
    """The prompt text the policy sees and its token ids (see ``build_prompts``).

    Raises:
        DatasetError: malformed ``messages``, images or videos without a vision-language
            processor, videos for a vision-language model without a ``<|video_pad|>`` token, a
            video whose frames cannot be sized (``VLProcessor.prompt_ids``), a template placeholder other than {prompt}/{system_prompt},
            ``prompt_template`` with a processor, or no way to render (no chat template and no
            ``prompt_template``).
    """
    messages = entry.get("messages")
    if messages is not None:
        messages = _checked_messages(messages, where)
    if processor is None and (images or videos):
        what = " and ".join(f"{len(x)} {kind}(s)" for x, kind in ((images, "image"), (videos, "video")) if x)
        raise DatasetError(f"{where} has {what} but the policy is a text-only model")
    if prompt_template is not None:
        if processor is not None:
            raise DatasetError(f"{where}: data.prompt_template is for text-only models, the policy is a vision-language model")
        if messages is not None:
            raise DatasetError(f"{where}: the prompt is a list of chat messages, which data.prompt_template cannot "
                               "render; use a tokenizer with a chat template (or give the prompt as text)")
        try:
            text = prompt_template.format(prompt=str(entry["question"]), system_prompt=system_prompt)
        except (KeyError, IndexError, ValueError) as exc:
            raise DatasetError(f"data.prompt_template {prompt_template!r}: bad placeholder {exc}; "
                               "it may use {prompt} and {system_prompt}") from exc
        return text, list(tokenizer(text)["input_ids"])
    if processor is not None:
        if messages is None:
            text = processor.render_prompt(str(entry["question"]), len(images), system_prompt, n_videos=len(videos))
        else:
            text = processor.tokenizer.apply_chat_template(_with_placeholders(messages, len(images), len(videos), where),
                                                           add_generation_prompt=True, tokenize=False)
        try:
            return text, processor.prompt_ids(text, images, videos, where=where)
        except ValueError as exc:  # VLError / VideoError: the message names the row and the video
            raise DatasetError(str(exc)) from exc
    if getattr(tokenizer, "chat_template", "") is None:
        raise DatasetError(f"{where}: the tokenizer has no chat template; set data.prompt_template (e.g. "
                           "'Question: {prompt}\\nAnswer:') for plain-text prompts, or use a chat model")
    if messages is None:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": str(entry["question"])}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


CHAT_ROLES = ("system", "user", "assistant", "tool")
IMAGE_MARKER, VIDEO_MARKER = "<image>", "<video>"  # verl's markers of an image's / video's place in a message


def _checked_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` if it is a non-empty list of {role, content: str} with a non-empty user turn."""
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: message {k} must be {{role: one of {list(CHAT_ROLES)}, content: str}}, "
                               f"got {m!r:.120}")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: empty prompt (no user message with text)")
    return messages


def _with_placeholders(messages: list[dict[str, Any]], n_images: int, n_videos: int, where: str) -> list[dict[str, Any]]:
    """Messages for a vision-language template. Per kind: each ``<image>`` / ``<video>`` marker
    becomes the processor's placeholder (verl's convention); without markers, the placeholders
    go before the text of the first user message, images first (as ``VLProcessor.render_prompt``).

    Raises:
        DatasetError: markers of a kind present but not one per item.
    """
    out = [dict(m) for m in messages]
    for marker, placeholder, n in ((VIDEO_MARKER, VIDEO_PLACEHOLDER, n_videos), (IMAGE_MARKER, IMAGE_PLACEHOLDER, n_images)):
        n_markers = sum(m["content"].count(marker) for m in out)
        if n_markers not in (0, n):
            raise DatasetError(f"{where}: the messages have {n_markers} {marker} markers but the row has {n} {marker[1:-1]}s")
        if n_markers:
            for m in out:
                m["content"] = m["content"].replace(marker, placeholder)
        elif n:
            first = next(m for m in out if m["role"] == "user")
            first["content"] = placeholder * n + first["content"]
    return out
