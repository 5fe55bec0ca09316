"""The whole dataset checked before a training run starts (issue 30).

With ``data.source: files`` an iteration reads only the rows it draws, so a bad row used to
surface only when some iteration happened to draw it: a run could train for hours and then
stop. ``validate_run_data`` runs once, before the first stage of a run (the train flow's
``validate_data`` task): every row of the data files (``data.path`` or each ``data.sources``
file) is checked against what the run needs. The held-out file ``eval.path`` is not: a training
run never reads it (the train flow runs no evaluation; ``rft eval`` does, and its prompts stage
checks the rows it reads), so a preset's ``eval.path`` need not exist to train. ``rft data
check`` (``rft_core.data.check``) runs the same checks on the dataset it is given. A row needs:

- a prompt: text that is not blank, or chat messages (a non-empty list of {role, content} with a
  known role, content as text or a list of text/image/video parts, and a user turn with text);
- a reference answer (not null, not blank) when a grader of the reward config reads one
  (``RewardConfig.needs_reference``: ``math_answer``, ``exact_match``, ``remote``, ``python``,
  an ``llm_judge`` whose template shows ``{reference}``),
  of a type a text-comparing grader can read (``math_answer``, ``exact_match``: text, a number,
  a bool or chat messages);
- the metadata columns a grader reads (``code_exec``: ``test`` and ``entry_point``, text, not null);
- image and video paths that exist (relative ones from the data file's folder);
- with the ``dataset`` grader (reasoning-gym's own scorer, chosen by each row's label), labels
  that name a reasoning-gym dataset (``reward.grader=dataset`` on a user's file is refused here,
  before the prompts stage, naming both keys and the fix).

The checks are Arrow compute over whole columns, one record batch at a time (Parquet: only the
columns needed, batch by batch, so memory stays bounded by a batch; JSON Lines / JSON / CSV: the
table ``FileDataset`` already holds): null masks, trimmed string lengths, list lengths, and the
messages flattened with their parent row indices. Only the rows found bad and listed (the
first ``MAX_LISTED``) go through the Python row check of the prompts stage (``row_entry``), so
each is reported with the very message that stage would give: file, ``line N (row n)`` for JSON
Lines (1-based lines as an editor shows them, blank lines counted) or ``row n`` (0-based) for
the other formats, the column and the problem.

A dataset that passes is remembered under the run root, ``{run_root}/_data_checks/{key}.json``,
``key`` hashing the files' fingerprints (``rft_core.data.mixture.dataset_fingerprint``: sizes and
versions, no row read), the column mapping, the format and what the graders need: a resumed run
finds the marker and reads no row again; an edited file changes the key.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rft_core.data.columns import MEDIA_KEYS, field_type
from rft_core.data.column_checks import (
    _blank, _column, _Exists, _is_text, _labels, _labels_bad, _answer_bad, _answer_type_problem, _media_paths,
    _messages_bad, _np, _to_rows,
)
from rft_core.data.mixture import dataset_fingerprint, open_data_config
from rft_core.data.prompts import DatasetError, is_reasoning_gym_dataset
from rft_core.data.readers import is_local_fs

VERSION = 2  # of the checks: part of the cache key, so changed checks run again
MAX_LISTED = 20  # bad rows listed in the error (all are counted)
BATCH_ROWS = 65_536  # rows checked at a time
CHECKS_DIR = "_data_checks"  # under the run root: one marker per validated dataset version


class DataValidationError(DatasetError):
    """Rows of the run's data cannot be used; ``report`` (a ``ValidationReport``) lists the first
    ``MAX_LISTED`` (file, line or row, column, problem) and counts them all."""

    def __init__(self, report: "ValidationReport") -> None:
        super().__init__(report.message())
        self.report = report


@dataclass(frozen=True)
class Needs:
    """What the run needs of every row.

    Attributes:
        answer: a reference answer (not null, not blank).
        answer_as_text: the answer is compared as text, so its column must be text, a number,
            a bool or chat messages.
        metadata: columns graders read from the row's metadata (non-null text), with the grader.
        media: image/video paths must exist.
        labels: the labels (``data_source``) that have a reward recipe, when there is no
            default recipe (a row with another label cannot be graded); None: any label.
        dataset_grader: the key of the ``dataset`` grader (``reward.grader`` or
            ``reward.sources.<name>.grader``) when a recipe uses it, else None.
        dataset_graded: the recipe labels whose recipe uses it.
        dataset_graded_by_default: the default recipe uses it (labels without a recipe).
        recipe_labels: every recipe's label.
    """

    answer: bool = True
    answer_as_text: bool = False
    metadata: tuple[tuple[str, str], ...] = ()
    media: bool = True
    labels: tuple[str, ...] | None = None
    dataset_grader: str | None = None
    dataset_graded: tuple[str, ...] = ()
    dataset_graded_by_default: bool = False
    recipe_labels: tuple[str, ...] = ()

    @classmethod
    def of(cls, reward, *, media: bool = True) -> "Needs":
        """What the graders of ``reward`` (a ``RewardConfig``) read: the sources its recipes use
        (all labels' together), the labels it has recipes for, and which labels the ``dataset``
        grader (reasoning-gym's own scorer, chosen by the label) grades."""
        used = reward.used_sources()
        meta = {name: src.type for src in used for name in src.metadata_fields}
        resolved = reward.resolved
        labels = tuple(sorted(resolved.recipes)) if resolved.default_recipe is None else None
        rg = {name for name, src in resolved.sources.items() if src.type == "math_answer" and src.grader == "dataset"}
        graded = tuple(sorted(label for label, items in resolved.recipes.items() if any(i.source in rg for i in items)))
        key = None
        if rg:
            key = "reward.grader" if not reward.sources else f"reward.sources.{sorted(rg)[0]}.grader"
        return cls(answer=any(s.needs_reference for s in used), answer_as_text=any(s.reference_as_text for s in used),
                   metadata=tuple(sorted(meta.items())), media=media, labels=labels,
                   dataset_grader=key if graded else None, dataset_graded=graded,
                   dataset_graded_by_default=resolved.default_recipe in graded,
                   recipe_labels=tuple(sorted(resolved.recipes)))

    def foreign_label(self, label: str) -> bool:
        """Whether the ``dataset`` grader would have to grade rows labelled ``label`` (its recipe,
        or the default recipe for a label without one, uses it) and no reasoning-gym dataset has
        that name."""
        if self.dataset_grader is None:
            return False
        graded = label in self.dataset_graded if label in self.recipe_labels else self.dataset_graded_by_default
        return graded and not is_reasoning_gym_dataset(label)

    def foreign_label_problem(self, label: str) -> str:
        """The message for rows labelled ``label`` that the ``dataset`` grader cannot grade."""
        return (f"label {label!r} names no reasoning-gym dataset, but {self.dataset_grader}=dataset grades each row "
                f"with the reasoning-gym dataset its label names (data.source=files): set {self.dataset_grader}="
                "math_verify (symbolic math answers), or an exact_match source")


@dataclass
class ValidationReport:
    """The result of validating the datasets of a run.

    Attributes:
        datasets: what was validated, by config key (``data.path '...'``, or each
            ``data.sources[k].path '...'``).
        rows: rows checked.
        bad_rows: rows with a problem (all counted).
        problems: the first ``MAX_LISTED`` bad rows, each as the prompts stage names it:
            '{file} line L (row n): ... column ...' (JSON Lines) or '{file} row n: ...'.
        file_problems: problems of a whole file or column (a type the grader cannot read, a
            column it needs missing, an unreadable Parquet row group).
        fingerprint: the datasets' fingerprints.
        seconds: the time the checks took (0 when cached).
        cached: True when a marker of an earlier validation was found (nothing read).
    """

    datasets: list[str] = field(default_factory=list)
    rows: int = 0
    bad_rows: int = 0
    problems: list[str] = field(default_factory=list)
    file_problems: list[str] = field(default_factory=list)
    fingerprint: str = ""
    seconds: float = 0.0
    cached: bool = False

    @property
    def ok(self) -> bool:
        """True when no row and no column has a problem."""
        return self.bad_rows == 0 and not self.file_problems

    def summary(self) -> str:
        """One line: what was validated, how many rows, and whether it came from the cache."""
        if not self.datasets:
            return "data: a generated task, no files to validate"
        what = " and ".join(self.datasets)
        if self.cached:
            return f"{what}: validated before (fingerprint {self.fingerprint}), not read again"
        return f"{what}: all {self.rows:,} rows valid ({self.seconds:.2f} s; fingerprint {self.fingerprint})"

    def message(self) -> str:
        """The error text: the counts, the file and column problems, then the listed bad rows
        ('the first 20 of N' when there are more), one per line."""
        what = " and ".join(self.datasets)
        head = (f"data validation failed before any stage ran, nothing was written: {self.bad_rows:,} bad row(s) "
                f"of {self.rows:,}" + (f" and {len(self.file_problems)} file problem(s)" if self.file_problems else "") +
                f" in {what}")
        lines = [f"  - {p}" for p in self.file_problems]
        if self.problems:
            shown = len(self.problems)
            lines.append(f"  bad rows (the first {shown} of {self.bad_rows:,}):" if self.bad_rows > shown else "  bad rows:")
            lines += [f"  - {p}" for p in self.problems]
        if self.bad_rows > len(self.problems):
            lines.append(f"  ... and {self.bad_rows - len(self.problems):,} more bad row(s)")
        return head + "\n" + "\n".join(lines)


def check_batch(batch: pa.RecordBatch, layout, needs: Needs, *, base_dir: str, name: str = "",
                exists: _Exists | None = None) -> list[tuple[np.ndarray, str, str]]:
    """The column-wise checks of one record batch of a file.

    Args:
        batch: rows of the file (at least the top-level columns the layout uses).
        layout: the file's ``rft_core.data.columns.Layout``.
        base_dir: the folder relative image/video paths start from.
        name: the label of rows without a ``data_source`` (the dataset's name), when
            ``needs.labels`` is set and the file has a data_source column (a file without one,
            or with an override, has one label for all rows: ``validate_dataset`` checks it once).
    Returns:
        (bad-row mask, column, problem) per check that flags a row, in the order the prompts
        stage checks a row (prompt, answer, metadata, media), then the label.
    """
    exists = exists or _Exists()
    cols, out = layout.columns, []
    prompt = _column(batch, cols["prompt"])
    if layout.prompt_kind == "messages":
        out.append((_messages_bad(prompt), cols["prompt"], "bad chat messages"))
    else:
        out.append((_blank(prompt), cols["prompt"], "no prompt (null or blank)"))
    if needs.answer and "answer" in cols:
        out.append((_answer_bad(_column(batch, cols["answer"])), cols["answer"], "no answer (null or blank)"))
    for name, grader in needs.metadata:
        if name in batch.schema.names:
            out.append((_np(pc.is_null(batch.column(name))), name, f"null; the {grader} grader reads it"))
    for key in MEDIA_KEYS if needs.media else ():
        if key in cols:
            bad, paths, parents = _media_paths(_column(batch, cols[key]), base_dir)
            missing = _to_rows(exists.missing(paths), parents, len(batch)) if len(paths) else np.zeros(len(batch), bool)
            out.append((bad | missing, cols[key], f"{key[:-1]} that is not bytes or an existing path"))
    if needs.labels is not None and "data_source" in cols:
        out.append((_labels_bad(_column(batch, cols["data_source"]), name, needs.labels), cols["data_source"],
                    f"a label without a reward recipe (recipes: {', '.join(needs.labels)}; reward.default_recipe "
                    "is not set)"))
    if needs.dataset_grader is not None and "data_source" in cols:
        label = _labels(_column(batch, cols["data_source"]), name)
        foreign = [v for v in pc.unique(label).to_pylist() if needs.foreign_label(v)]  # a few distinct labels
        if foreign:
            out.append((_np(pc.is_in(label, value_set=pa.array(foreign, label.type))), cols["data_source"],
                        needs.foreign_label_problem(foreign[0])))
    return [c for c in out if c[0].any()]


def _schema_problems(ds, k: int, needs: Needs) -> list[str]:
    """Problems of a whole column of file ``k`` (a type the grader cannot read, a missing column),
    or of its one label (a ``data_source`` override, or no data_source column)."""
    part, layout, out = ds.parts[k], ds.layouts[k], []
    label = ds.data_source or (None if "data_source" in layout.columns else ds.name)
    if needs.labels is not None and label is not None and label not in needs.labels:
        out.append(f"{part.uri}: its rows' label {label!r} has no reward recipe (recipes: {', '.join(needs.labels)}; "
                   "add one under reward.recipes, or set reward.default_recipe)")
    elif label is not None and needs.foreign_label(label):
        out.append(f"{part.uri}: every row's " + needs.foreign_label_problem(label) +
                   ("" if ds.data_source else " (a file without a data_source column is labelled with its name)"))
    if needs.answer and needs.answer_as_text and "answer" in layout.columns:
        t = field_type(part.schema, layout.columns["answer"])
        problem = _answer_type_problem(t)
        if problem:
            out.append(f"{part.uri}: column {layout.columns['answer']!r} (used as answer) has type {t}: {problem}")
    for name, grader in needs.metadata:
        if name not in part.schema.names:
            out.append(f"{part.uri}: no column {name!r}; the {grader} grader reads it from each row "
                       f"(columns: {part.schema.names})")
        elif not _is_text(part.schema.field(name).type):
            out.append(f"{part.uri}: column {name!r} has type {part.schema.field(name).type}; the {grader} grader "
                       "reads it as text")
    return out


def _keys(ds, needs: Needs) -> tuple[str, ...]:
    """Our keys whose columns the checks read (the answer always: the listed rows' own check reads it)."""
    labels = needs.labels is not None or needs.dataset_grader is not None
    return ("prompt", "answer", *(MEDIA_KEYS if needs.media else ()), *(("data_source",) if labels and not ds.data_source else ()))


def _heads(ds, k: int, needs: Needs) -> list[str]:
    """The top-level columns of file ``k`` the checks read."""
    names, cols = ds.parts[k].schema.names, ds.layouts[k].columns
    wanted = [c if c in names else c.split(".")[0] for key, c in cols.items() if key in _keys(ds, needs)]
    wanted += [name for name, _ in needs.metadata if name in names]
    return list(dict.fromkeys(wanted))


def _batches(ds, k: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The record batches of file ``k`` with only ``columns``: Parquet read batch by batch, the
    other formats sliced from the table ``FileDataset`` holds.

    Raises:
        DatasetError: a Parquet row group that cannot be read.
    """
    part = ds.parts[k]
    table = getattr(part, "table", None)
    if table is not None:
        yield from table.select(columns).to_batches(max_chunksize=BATCH_ROWS)
        return
    import pyarrow.parquet as pq

    fs, path = ds.files.fs, ds.files.paths[k]
    try:
        with (pq.ParquetFile(path) if is_local_fs(fs) else pq.ParquetFile(fs.open(path, "rb"))) as pf:
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{part.uri}: cannot be read (corrupt file?): {exc}") from exc


def _explain(ds, k: int, row: int, values: dict[str, Any], fallback: str) -> str:
    """The prompts stage's own message for a bad row (``FileDataset._entry``), else ``fallback``."""
    try:
        ds._entry(k, row, values)
    except DatasetError as exc:
        return str(exc)
    return f"{ds.where_in(k, row)} column {fallback}"


def _validate_file(ds, k: int, needs: Needs, report: ValidationReport, exists: _Exists, max_listed: int) -> None:
    """Add file ``k`` of ``ds`` to ``report``: its rows, bad rows, listed problems."""
    report.file_problems += _schema_problems(ds, k, needs)
    start = 0
    try:
        for batch in _batches(ds, k, _heads(ds, k, needs)):
            checks = check_batch(batch, ds.layouts[k],
                                 needs if not ds.data_source else replace(needs, labels=None, dataset_grader=None),
                                 base_dir=ds.parts[k].base_dir, name=ds.name, exists=exists)
            first, start = start, start + len(batch)
            report.rows += len(batch)
            if not checks:
                continue
            bad = np.logical_or.reduce([c[0] for c in checks])
            report.bad_rows += int(bad.sum())
            rows = np.flatnonzero(bad)[:max(max_listed - len(report.problems), 0)]
            if len(rows):  # only the listed rows go through the stage's own Python check, for its message
                values = batch.take(pa.array(rows, pa.int64())).to_pylist()
                for r, v in zip(rows.tolist(), values):
                    col, what = next((c, w) for m, c, w in checks if m[r])
                    report.problems.append(_explain(ds, k, first + r, v, f"{col!r}: {what}"))
    except DatasetError as exc:  # an unreadable Parquet row group: the rest of the file is not checked
        report.file_problems.append(str(exc))


def validate_dataset(ds, needs: Needs = Needs(), *, max_listed: int = MAX_LISTED,
                     report: ValidationReport | None = None) -> ValidationReport:
    """Check every row of ``ds`` (a ``FileDataset`` or ``MixtureDataset``, opened with
    ``require_answer=needs.answer``) column-wise; see the module docstring.

    Returns:
        the report (``report`` when given, with this dataset's rows and problems added; a new
        one naming its paths by config key otherwise: ``data.path 'train.jsonl'``). Bad rows,
        unusable columns and unreadable Parquet row groups go into the report; nothing is
        raised for them.
    """
    subs = getattr(ds, "sources", None) or [ds]
    report = report or ValidationReport(datasets=[", ".join(f"{sub.key} {sub.path!r}" for sub in subs)])
    exists = _Exists()
    for sub in subs:
        for k in range(len(sub.parts)):
            _validate_file(sub, k, needs, report, exists, max_listed)
    return report


# ------------------------------------------------------------------------------- a training run

def _label(data) -> str:
    """How reports name the training files of a ``DataConfig``: by config key and path,
    ``data.path 'train.jsonl'`` or ``data.sources[0].path 'a.jsonl', data.sources[1].path 'b.jsonl'``."""
    if data.path is not None:
        return f"data.path {data.path!r}"
    return ", ".join(f"data.sources[{k}].path {s.path!r}" for k, s in enumerate(data.sources))


def _datasets(cfg, needs: Needs) -> list[tuple[str, Any]]:
    """(label, opener) of each dataset a training run reads: the training files (``eval.path``
    is read by ``rft eval`` only: see the module docstring)."""
    data = cfg.data
    if data.source != "files":
        return []
    return [(_label(data), lambda: open_data_config(data, require_answer=needs.answer))]


def _fingerprints(cfg) -> str:
    return dataset_fingerprint(cfg.data) or ""


def cache_key(cfg, needs: Needs, fingerprint: str) -> str:
    """sha256 (16 hex) of what decides the validation's outcome: the checks' version, the files'
    fingerprints, the data settings that say how rows are read (path, sources, format, columns)
    and ``needs``."""
    data = cfg.data
    what = {"version": VERSION, "fingerprint": fingerprint, "needs": asdict(needs),
            "data": data.model_dump(mode="json", include={"path", "format", "columns", "sources"})}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _marker(run_root: str, key: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(f"{run_root.rstrip('/')}/{CHECKS_DIR}/{key}.json")


def validate_run_data(cfg, *, use_cache: bool = True, max_listed: int = MAX_LISTED) -> ValidationReport:
    """Validate every row of the files a training run reads, once per version of the data.

    Args:
        cfg: a ``rft_core.config.TrainConfig``: ``data`` (``source: files``: ``path`` or
            ``sources``, ``format``, ``columns``), ``reward`` (what the graders read,
            ``Needs.of``) and ``run_root`` (where the marker of a passed validation goes).
            ``eval.path`` is not read: the train flow runs no evaluation.
        use_cache: look for (and write) the marker ``{run_root}/_data_checks/{cache_key}.json``.
    Returns:
        the report (``cached`` True when the marker was found: no row was read). A run with a
        generated task has nothing to validate: an empty report.
    Raises:
        DataValidationError: bad rows or unusable columns; the message lists the first
            ``max_listed`` (file, ``line N (row n)`` for JSON Lines or ``row n``, column,
            problem) and counts them all. Raised before any stage, so nothing is committed.
        DatasetError: a dataset that cannot be opened (no such file, unparsable, a mapping
            naming an absent column, no prompt or needed answer column); the message starts with
            the config key of the path (``data.path``, ``data.sources[k].path``).
    """
    needs = Needs.of(cfg.reward)
    datasets = _datasets(cfg, needs)
    report = ValidationReport(datasets=[label for label, _ in datasets])
    if not datasets:
        return report
    report.fingerprint = _fingerprints(cfg)
    key = cache_key(cfg, needs, report.fingerprint)
    if use_cache:
        fs, path = _marker(cfg.run_root, key)
        try:
            record = json.loads(fs.cat_file(path))
            report.rows, report.cached = int(record["rows"]), True
            return report
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no marker (or an unreadable one): validate
    t = time.perf_counter()
    for _, opener in datasets:
        validate_dataset(opener(), needs, max_listed=max_listed, report=report)
    report.seconds = time.perf_counter() - t
    if not report.ok:
        raise DataValidationError(report)
    if use_cache and _fingerprints(cfg) == report.fingerprint:  # a file edited meanwhile: no marker
        record = {"rows": report.rows, "datasets": report.datasets, "fingerprint": report.fingerprint,
                  "seconds": round(report.seconds, 3), "needs": asdict(needs), "version": VERSION,
                  "validated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, json.dumps(record, indent=1).encode())
    return report
