"""``rft data check PATH [-c cfg]``: what the trainer will make of a dataset, before training.

``check_data`` opens the dataset as training would (``rft_core.data.mixture.open_data``), checks
every row with the column checks ``rft train`` runs before its first stage
(``rft_core.data.validate.validate_dataset``: the same checks, the same messages), and renders
the first prompts exactly as the policy sees them (the chat template or ``prompt_template``
applied, via ``build_prompts``); ``render_report`` turns the result into text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rft_core.data.mixture import open_data, source_dicts
from rft_core.data.prompts import DatasetError, build_prompts
from rft_core.data.validate import Needs, validate_dataset
from rft_core.models.hub import ModelLoadError
from rft_core.models.loading import load_tokenizer
from rft_core.models.vl import vl_processor_or_none


@dataclass
class SourceReport:
    """One path of the dataset (a mixture has several).

    Attributes:
        path, format: as resolved (``format`` detected when ``auto``).
        files: the data files read.
        style: the detected layout (verl, trl_conversational, trl_standard, plain, mapped).
        columns: our key -> the file's column, as used.
        prompt_kind: "text" or "messages".
        metadata_columns: columns copied into each entry's metadata.
        rows: row count.
        weight: the mixture weight (None outside a mixture).
    """

    path: str
    format: str
    files: list[str]
    style: str
    columns: dict[str, str]
    prompt_kind: str
    metadata_columns: list[str]
    rows: int
    weight: float | None = None


@dataclass
class PromptExample:
    """One rendered prompt: where it comes from, its text as the policy sees it, its token
    count, its reference answer and its data_source label."""

    where: str
    prompt_text: str
    n_tokens: int
    answer: str
    data_source: str


@dataclass
class DataCheckReport:
    """The result of ``check_data``.

    Attributes:
        sources: one per path.
        rows: total rows.
        bad_rows: rows with a problem (every row checked, as ``rft train`` checks them).
        examples: rendered prompts (the first rows without problems).
        problems: every problem of a whole file or column, the first ``max_problems`` bad rows'
            messages (the texts ``rft train`` gives), and overlong example prompts; or the error
            that stopped the dataset from opening.
        fingerprint: ``rft_core.data.files.fingerprint_files`` of the files (None if unopenable).
    """

    sources: list[SourceReport] = field(default_factory=list)
    rows: int = 0
    bad_rows: int = 0
    examples: list[PromptExample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fingerprint: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems and self.bad_rows == 0

    def render(self) -> str:
        """``render_report(self)``."""
        return render_report(self)


def _source_report(ds, weight: float | None = None) -> SourceReport:
    return SourceReport(ds.path, ds.format, [p.uri for p in ds.parts], ds.layout.style, dict(ds.layout.columns),
                        ds.layout.prompt_kind, list(ds.layout.metadata_columns), len(ds), weight)


def _candidates(ds, limit: int) -> list[int]:
    """Global indices to try as examples: the first rows, taken from each source in turn."""
    subs = getattr(ds, "sources", None)
    if not subs:
        return list(range(min(limit, len(ds))))
    out = []
    for r in range(limit):
        out += [ds.global_index(s, r) for s, sub in enumerate(subs) if r < len(sub)]
    return out[:limit]


def check_data(tokenizer, *, path: str | None = None, sources: Sequence[Mapping[str, Any]] | None = None,
               format: str = "auto", columns: Mapping[str, str] | None = None, data_source: str | None = None,
               system_prompt: str = "", prompt_template: str | None = None, max_prompt_tokens: int | None = None,
               processor=None, n_examples: int = 2, max_problems: int = 50, check_media: bool = True,
               require_answer: bool = True, needs: Needs | None = None) -> DataCheckReport:
    """Open, check and render a dataset the way a training run would.

    Args:
        tokenizer: the policy's tokenizer, or a model path/alias (then loaded with
            ``rft_core.models.loading.load_tokenizer``, and ``processor`` set for a
            vision-language model).
        path, sources, format, columns, data_source: as ``open_data`` (the ``data`` config).
        system_prompt, prompt_template, processor: as ``build_prompts``.
        max_prompt_tokens: examples longer than this are reported as problems (None: no limit).
        n_examples: prompts to render (the first rows without problems; one per source in turn).
        max_problems: bad rows listed (all are counted in ``bad_rows``).
        check_media: check that every image/video path exists.
        require_answer: False when the grader reads no reference answer (rows without one pass).
        needs: what the graders read of every row (``Needs.of(cfg.reward)``, as ``rft train``);
            None: ``Needs(answer=require_answer, media=check_media)``, which then override
            ``require_answer`` and ``check_media``.
    Returns:
        a ``DataCheckReport``; never raises ``DatasetError`` (problems go into the report).
    """
    if isinstance(tokenizer, str):
        processor = processor if processor is not None else vl_processor_or_none(tokenizer)
        tokenizer = load_tokenizer(tokenizer)
    needs = needs if needs is not None else Needs(answer=require_answer, media=check_media)
    report = DataCheckReport()
    try:
        ds = open_data(path, format=format, columns=columns, sources=sources, data_source=data_source,
                       require_answer=needs.answer)
    except DatasetError as exc:
        report.problems.append(str(exc))
        return report
    subs = getattr(ds, "sources", None)
    report.sources = ([_source_report(s, w) for s, w in zip(subs, ds.weights)] if subs else [_source_report(ds)])
    report.rows, report.fingerprint = len(ds), ds.fingerprint()
    checked = validate_dataset(ds, needs, max_listed=max_problems)
    report.bad_rows, report.problems = checked.bad_rows, checked.file_problems + checked.problems
    for i in _candidates(ds, limit=max(n_examples, 1) * 50):
        if len(report.examples) >= n_examples:
            break
        where = ds.where(i)
        if any(p.startswith((f"{where}:", f"{where} column")) for p in checked.problems):
            continue  # a row the checks refused (its label, say, which the row's own read does not check)
        try:
            (index, entry), = ds.entries([i])
            table = build_prompts([(index, entry)], tokenizer, data_source=ds.name, system_prompt=system_prompt,
                                  max_prompt_tokens=1 << 62, processor=processor, prompt_template=prompt_template).table
        except DatasetError as exc:
            if str(exc) not in report.problems:
                report.problems.append(str(exc))
            continue
        n = len(table.column("prompt_token_ids")[0].as_py())
        report.examples.append(PromptExample(where, table.column("prompt_text")[0].as_py(), n,
                                             table.column("answer")[0].as_py(), table.column("data_source")[0].as_py()))
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            report.problems.append(f"{where}: prompt has {n} tokens, data.max_prompt_tokens is {max_prompt_tokens}")
    return report


def render_report(report: DataCheckReport) -> str:
    """The report as plain text: per source its format, files, layout, column mapping, metadata
    columns and rows; the fingerprint; the rendered example prompts between rule lines; every
    problem; and a last line ``OK`` or ``FAILED: ...``."""
    lines: list[str] = []
    for s in report.sources:
        weight = f" (weight {s.weight})" if s.weight is not None else ""
        lines.append(f"dataset {s.path}{weight}")
        lines.append(f"  format:   {s.format}, {len(s.files)} file(s): {', '.join(s.files[:3])}{' ...' if len(s.files) > 3 else ''}")
        lines.append(f"  layout:   {s.style} (prompt as {'chat messages' if s.prompt_kind == 'messages' else 'text'})")
        lines.append("  columns:  " + ", ".join(f"{k} <- {v}" for k, v in s.columns.items()))
        lines.append(f"  metadata: {', '.join(s.metadata_columns) or '(none)'}")
        lines.append(f"  rows:     {s.rows}")
    if report.sources:
        lines.append(f"rows: {report.rows}   fingerprint: {report.fingerprint}")
    for k, ex in enumerate(report.examples, 1):
        lines.append(f"prompt {k}: {ex.where}, data_source {ex.data_source!r}, {ex.n_tokens} tokens, answer {ex.answer!r}")
        lines.append("-" * 72)
        lines.append(ex.prompt_text)
        lines.append("-" * 72)
    if report.problems:
        counted = f"{report.bad_rows} bad row(s); " if report.bad_rows else ""
        lines.append(f"problems ({counted}{len(report.problems)} listed):")
        lines += [f"  - {p}" for p in report.problems]
    lines.append("OK" if report.ok else f"FAILED: {report.bad_rows} bad row(s), {len(report.problems)} problem(s)")
    return "\n".join(lines)


def check_config_data(cfg, path: str | None = None, *, n_examples: int = 2, max_problems: int = 50) -> DataCheckReport:
    """``check_data`` of what a training config would read: ``path`` (any file, e.g. the
    held-out ``eval.path``) or else the config's own ``data.path`` / ``data.sources``, with its
    ``data`` settings (format, columns, system_prompt, prompt_template, max_prompt_tokens), the
    tokenizer (and vision-language processor) of ``policy.path``, and the row checks of
    ``rft train`` for what the graders of ``reward`` read (``Needs.of``: an answer only when one
    reads it, its type, metadata columns, labels with a recipe).

    Args:
        cfg: a ``rft_core.config.TrainConfig``.
    Returns:
        a ``DataCheckReport``; with neither ``path`` nor a files dataset in ``cfg``, or a
        tokenizer that cannot be loaded, a report whose only problem says so.
    """
    data = cfg.data
    if path is None and data.source != "files":
        report = DataCheckReport()
        report.problems.append("no dataset to check: give a PATH, or a config with data.source: files "
                               "(and data.path or data.sources)")
        return report
    try:
        tokenizer, processor = load_tokenizer(cfg.policy.path), vl_processor_or_none(cfg.policy.path)
    except ModelLoadError as exc:
        report = DataCheckReport()
        report.problems.append(f"policy.path (the tokenizer prompts are rendered with): {exc}")
        return report
    sources = source_dicts(data) if path is None else None
    return check_data(tokenizer, processor=processor, path=path if path is not None else (None if sources else data.path),
                      sources=sources, format=data.format, columns=data.columns or None,
                      system_prompt=data.system_prompt, prompt_template=data.prompt_template,
                      max_prompt_tokens=data.max_prompt_tokens, n_examples=n_examples, max_problems=max_problems,
                      needs=Needs.of(cfg.reward))
