"""Where the prompts come from: the training data (``data``) and the held-out evaluation
(``eval``).

``data.source`` picks the kind: ``reasoning_gym`` (a generated task, the default: ``task``,
``task_config``, ``size``) or ``files`` (users' own files: ``path`` or a weighted mixture of
``sources``, read by ``rft_core.data.mixture.open_data``; ``size`` is ignored, the files'
rows are the dataset). Every field added for ``files`` defaults to a value that leaves a
reasoning-gym config, and its config hash, exactly as before.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rft_core.config._base import _Frozen
from rft_core.data.columns import KEYS as COLUMN_KEYS

DataFormat = Literal["auto", "parquet", "jsonl", "json", "csv", "hf_disk"]


def _check_columns(columns: dict[str, str] | None, where: str) -> dict[str, str] | None:
    """``columns`` if every key is one of ``rft_core.data.columns.KEYS`` and every value a
    non-empty column name."""
    if columns is None:
        return None
    unknown = sorted(set(columns) - set(COLUMN_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {list(COLUMN_KEYS)}")
    blank = sorted(k for k, v in columns.items() if not str(v).strip())
    if blank:
        raise ValueError(f"{where}: empty column name for {blank}")
    return columns


class DataSourceConfig(_Frozen):
    """One source of a mixture (``data.sources``): a path drawn with probability
    weight / (sum of the weights) per prompt (``rft_core.data.mixture``)."""

    path: str = Field(min_length=1, description="a file, glob, folder, save_to_disk folder or fsspec URI")
    weight: float = Field(1.0, gt=0, description="relative share of each iteration's prompts")
    data_source: str | None = Field(None, description="label of every row of this source (None: the row's "
                                    "data_source column, else the file name)")
    columns: dict[str, str] | None = Field(None, description="our key -> the file's column (None: data.columns)")
    format: DataFormat | None = Field(None, description="None: data.format")

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"weight must be a finite number > 0, got {v}")
        return v

    _c = field_validator("columns")(lambda cls, v: _check_columns(v, "columns"))


class DataConfig(_Frozen):
    """Prompts from a reasoning-gym task (or the built-in ``humaneval``), seeded, or from users'
    files (``source: files``); each iteration takes the next slice of a seeded order."""

    source: Literal["reasoning_gym", "files"] = "reasoning_gym"
    task: str = "basic_arithmetic"
    task_config: dict[str, int | float | str | bool] = Field(default_factory=dict)
    size: int = Field(2000, gt=0, description="number of distinct training prompts (reasoning_gym; ignored for files)")
    seed: int = 1234
    prompts_per_iteration: int = Field(8, gt=0)
    system_prompt: str = (
        "You are a helpful assistant. Solve the problem. "
        "Give the final answer on the last line as: Answer: <answer>"
    )
    max_prompt_tokens: int = Field(256, gt=0)
    overlong_prompts: Literal["skip", "error"] = "skip"
    path: str | None = Field(None, description="files: a file, glob, folder, save_to_disk folder or fsspec URI")
    format: DataFormat = Field("auto", description="files: the format (auto: from the extension / folder)")
    columns: dict[str, str] = Field(default_factory=dict, description="files: our key (prompt, answer, data_source, "
                                    "images, videos) -> the file's column, dotted for a nested field")
    sources: list[DataSourceConfig] = Field(default_factory=list, description="files: a weighted mixture instead of path")
    prompt_template: str | None = Field(None, description="'Question: {prompt}\\nAnswer:' for a tokenizer without a "
                                        "chat template ({prompt}, {system_prompt})")

    _c = field_validator("columns")(lambda cls, v: _check_columns(v, "columns"))

    @model_validator(mode="after")
    def _check_source(self) -> "DataConfig":
        if self.source == "files":
            if (self.path is None) == (not self.sources):
                raise ValueError("data.source=files needs exactly one of data.path (one dataset) and data.sources "
                                 f"(a mixture); got {'both' if self.path is not None else 'neither'}")
            return self
        given = [k for k, v in (("path", self.path), ("sources", self.sources), ("columns", self.columns)) if v]
        given += ["format"] if self.format != "auto" else []
        if given:
            raise ValueError(f"data.{given[0]} is for data.source=files, but data.source is {self.source!r}; "
                             "set data.source=files to train on your own files")
        return self


class EvalConfig(_Frozen):
    """Held-out evaluation (``flows/eval.py``) on prompts of the training task whose prompts
    (question text and images/videos) never occur in the training dataset (``heldout_entries``), or, with
    ``path``, on the first ``num_prompts`` rows of a file of your own (read with ``data.format``
    and ``data.columns``; required when ``data.source`` is ``files``). Only ``rft eval`` reads
    ``path`` (the train flow runs no evaluation), so only it checks the file: a preset's
    ``eval.path`` need not exist to train.

    Decoding: one greedy answer per prompt by default (``n_samples`` 1, ``temperature`` unset);
    ``n_samples`` > 1 or a ``temperature`` > 0 samples ``n_samples`` answers per prompt and adds
    avg@k, pass@k (k = 1..n) and maj@n (``rft_core.evaluation.metrics``). Rule
    ``eval-sampling`` (docs/config.md): several answers need a temperature > 0, and ``top_p``
    applies only to sampling."""

    num_prompts: int = Field(200, gt=0, description="held-out prompts")
    seed: int | None = Field(None, description="dataset seed of the held-out split; None: data.seed + data.size + 1000003")
    max_new_tokens: int | None = Field(None, gt=0, description="None: rollout.max_new_tokens")
    batch_size: int = Field(32, gt=0, description="sequences generated at once")
    path: str | None = Field(None, description="held-out prompts from this file (first num_prompts rows); "
                             "required with data.source=files")
    n_samples: int = Field(1, gt=0, description="answers per prompt: 1 (with temperature unset) is one greedy answer; "
                           "> 1 samples them and reports avg@n, pass@1..n and maj@n")
    temperature: float | None = Field(None, ge=0, description="sampling temperature; None: rollout.temperature when "
                                      "n_samples > 1, greedy when n_samples = 1; 0: greedy (n_samples must be 1)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling; None: rollout.top_p (sampling only)")
    sampling_seed: int = Field(0, description="seed of the sampled answers (greedy decoding uses none)")

    @property
    def sampled(self) -> bool:
        """True when the answers are sampled (``n_samples`` > 1 or ``temperature`` > 0), False
        for greedy decoding."""
        return self.n_samples > 1 or bool(self.temperature)

    def decoding(self, rollout_temperature: float, rollout_top_p: float) -> tuple[float | None, float]:
        """(temperature, top_p) of the answers: (None, 1.0) for greedy decoding; when sampled,
        ``temperature`` / ``top_p`` or, where unset, the rollout's (``rollout.temperature``,
        ``rollout.top_p``: the policy is evaluated as it was trained to sample)."""
        if not self.sampled:
            return None, 1.0
        return (self.temperature or rollout_temperature), (self.top_p if self.top_p is not None else rollout_top_p)

    @model_validator(mode="after")
    def _check_sampling(self) -> "EvalConfig":
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.n_samples={self.n_samples} with eval.temperature=0 (greedy): every answer would be "
                             "the same; set eval.temperature > 0, or leave it unset (rollout.temperature)")
        if not self.sampled and self.top_p is not None:
            raise ValueError(f"eval.top_p={self.top_p:g} is set but decoding is greedy (eval.n_samples=1, eval.temperature "
                             "unset or 0): set eval.temperature > 0 or eval.n_samples > 1 to sample, or unset eval.top_p")
        return self
