"""Evaluation stages: score a checkpoint on a held-out split of the training task.

Three programs, run in order by ``flows/eval.py`` (the reward stage in between is the training
one, ``rft_core.stages.rewards.run``, so held-out rewards are graded exactly as in training):

``run_prompts``   held-out prompts (disjoint from the training dataset)               -> `prompts`
``run_generate``  one greedy response per prompt, or n sampled ones                   -> `rollout`
``run_summary``   prompts + rollout + rewards joined per sample, accuracy and mean reward -> `eval`
                  (sampled: avg@n, pass@1..n, maj@n per data_source and overall,
                  ``rft_core.evaluation.metrics``)

Greedy decoding (the default) writes the very shards, config hashes and summaries it wrote
before sampling existed; the sampling fields of the stage inputs are left at their defaults.
"""
from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc

from rft_core.data.files import FileDataset
from rft_core.data.mixture import heldout_fingerprint
from rft_core.data.prompts import DatasetError, PromptBatch, build_prompts, heldout_entries, heldout_seed
from rft_core.engines.hf import Generation, HFEngine
from rft_core.evaluation.metrics import PromptAnswers, mean_stderr, sampled_metrics, shown_ks
from rft_core.models.loading import leased_tokenizer, load_causal_lm, load_tokenizer
from rft_core.models.vl import vl_processor_or_none
from rft_core.models.logprobs import default_device
from rft_core.training.checkpoint import POLICY_FOLDER_SUFFIX
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.common import Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import EvalGenerateInput, EvalPromptsInput, EvalSummaryInput, stage_program
from rft_core.stages.lineage import weights_stage
from rft_core.stages.prompts import build_file_prompts, check_fingerprint, reuse_unless_data_changed, with_fingerprint
from rft_core.stages.rollout import rollout_summary
from schemas import PolicyRef, ShardError, ShardRef, ShardSchemaError, read_manifest, read_shard
from schemas.columns import EVAL, POLICY_CHECKPOINT, PROMPTS, ROLLOUT, policy_version_column, single_turn_columns

HELDOUT_PREFIX = "heldout"  # held-out prompt_ids: heldout-{task}-{index:06d}


def resolve_checkpoint(checkpoint: str | ShardRef) -> PolicyRef:
    """What a user names as a checkpoint, as a ``PolicyRef`` the stages can load.

    Accepted: a ``ShardRef`` of a committed ``ppo_update`` stage (returned as is); the folder of
    such a stage (``.../iter=000003/ppo_update``) or its ``policy/`` sub-folder; the folder of
    the ``ppo_update-policy`` stage holding the weights of one written in the background
    (``checkpoint.async_weights``), or its ``policy/`` sub-folder (what ``TrainResult.final_policy_folder``
    and the CLI name): that update; a run root (its last iteration with a committed
    ``ppo_update``); anything else is returned unchanged as a model path (the embedded
    default's alias, a local HF folder or a hub id).

    Raises:
        ShardError: the folder holds a committed stage other than ``ppo_update`` and
            ``policy_checkpoint``, a ``policy_checkpoint`` stage whose ``ppo_update`` sibling is not
            the update it names, or a run root has no committed ``ppo_update`` stage.
    """
    if isinstance(checkpoint, ShardRef):
        return checkpoint
    uri = checkpoint.rstrip("/")
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return checkpoint  # an alias or a hub id
    if PurePosixPath(path).name == "policy" and fs.exists(f"{path.rsplit('/', 1)[0]}/_MANIFEST.json"):
        uri = uri.rsplit("/", 1)[0]
        path = path.rsplit("/", 1)[0]
    if fs.exists(f"{path}/_MANIFEST.json"):
        manifest, _ = read_manifest(uri)
        if manifest.stage == POLICY_CHECKPOINT.stage and uri.endswith(POLICY_FOLDER_SUFFIX):
            update = ShardRef.from_manifest(uri.removesuffix(POLICY_FOLDER_SUFFIX))
            if update.manifest_sha256 != manifest.inputs.get("ppo_update"):
                raise ShardError(f"{uri}: its weights were written for another {update.uri} than the one committed there")
            return update
        if manifest.stage != "ppo_update":
            raise ShardError(f"{uri} is a committed {manifest.stage!r} stage; a checkpoint is a ppo_update stage folder, "
                             "its policy/ folder, a run root or a model folder")
        return ShardRef.from_manifest(uri)
    iters = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.glob(f"{path}/iter=*"))
    if iters:
        for it in reversed(iters):
            if fs.exists(f"{path}/{it}/ppo_update/_MANIFEST.json"):
                return resolve_checkpoint(f"{uri}/{it}/ppo_update")
        raise ShardError(f"{uri}: run root without a committed ppo_update stage (iterations: {', '.join(iters)})")
    return checkpoint


def checkpoint_label(policy: PolicyRef) -> str:
    """A human-readable name of ``policy``: the model path, or the folder holding a committed
    update's weights (``{ppo_update uri}/policy``, or ``{ppo_update uri}-policy/policy`` for weights
    written in the background, ``rft_core.stages.lineage.weights_stage``)."""
    if isinstance(policy, str):
        return policy
    return f"{(weights_stage(policy) or policy).uri}/policy"


@stage_program(EvalPromptsInput)
def run_prompts(inp: EvalPromptsInput) -> ShardRef:
    """Write the held-out prompts to ``out``.

    Without ``eval.path`` (a reasoning-gym or built-in task): ``eval.num_prompts`` prompts of
    ``data.task`` absent from the training dataset (question text and images / videos, see
    ``heldout_entries``); prompt_ids are
    ``heldout-{task}-{index:06d}``, ``data_source`` stays the task (the grader's key).
    With ``eval.path`` (required when ``data.source`` is ``files``): the first
    ``eval.num_prompts`` rows of that file (all of them when it has fewer), read with
    ``data.format`` and ``data.columns`` and rendered as training renders; prompt_ids are
    ``heldout-{file name}-{row:06d}``, each row's ``data_source`` picks its reward recipe. The
    file's fingerprint is in the config hash (``data_fingerprint``).

    Raises:
        DatasetError: ``eval.path`` not set while ``data.source`` is ``files``; not enough
            disjoint questions; an unreadable file or a bad row (naming file, row, column); or
            every prompt overlong. Raised before anything is written.
        DatasetChangedError: ``out`` was committed from another version of the ``eval.path`` file.
        StaleShardError: ``out`` is committed with another config.
    """
    data, cfg = inp.data, inp.eval
    if cfg.path is None and data.source == "files":
        raise DatasetError("eval.path is not set: with data.source=files the held-out prompts come from a file of your "
                           "own (eval.path, e.g. a test split whose questions are not in the training data)")
    if cfg.path is not None:
        inp = with_fingerprint(inp, lambda: heldout_fingerprint(data, cfg))
    commit = stage_commit(inp)

    def compute() -> ShardRef:
        with Timer() as t, leased_tokenizer(inp.tokenizer_path) as tok:
            processor = vl_processor_or_none(inp.tokenizer_path)
            batch, extra = (_heldout_file_prompts if cfg.path is not None else _heldout_task_prompts)(inp, tok, processor)
        if batch.table.num_rows == 0:
            raise DatasetError(f"held-out split: every prompt was longer than data.max_prompt_tokens={data.max_prompt_tokens}")
        summary = {"seconds": t.seconds, **extra, "skipped_overlong": len(batch.skipped_overlong)}
        return commit.write(batch.table, schema=PROMPTS, summary=summary)

    if cfg.path is None:
        return reuse_or_compute(commit, compute)
    return reuse_unless_data_changed(commit, compute, fingerprint=inp.data_fingerprint, dataset=repr(cfg.path))


def _heldout_task_prompts(inp: EvalPromptsInput, tok, processor) -> tuple[PromptBatch, dict[str, Any]]:
    """The held-out split of the reasoning-gym task of ``inp.data`` and its summary fields."""
    data, cfg = inp.data, inp.eval
    seed = heldout_seed(train_seed=data.seed, train_size=data.size, seed=cfg.seed)
    entries = heldout_entries(data.task, num_prompts=cfg.num_prompts, train_size=data.size, train_seed=data.seed,
                              seed=seed, task_config=data.task_config)
    batch = build_prompts(entries, tok, data_source=data.task, system_prompt=data.system_prompt,
                          max_prompt_tokens=data.max_prompt_tokens, overlong=data.overlong_prompts,
                          id_prefix=f"{HELDOUT_PREFIX}-{data.task}", processor=processor,
                          prompt_template=data.prompt_template)
    return batch, {"heldout_seed": seed, "train_seed": data.seed, "train_size": data.size,
                   "dataset_indices": [i for i, _ in entries]}


def _heldout_file_prompts(inp: EvalPromptsInput, tok, processor) -> tuple[PromptBatch, dict[str, Any]]:
    """The first ``eval.num_prompts`` rows of ``eval.path`` and their summary fields."""
    data, cfg = inp.data, inp.eval
    ds = FileDataset(cfg.path, format=data.format, columns=data.columns or None, require_answer=inp.answer_required,
                     key="eval.path")
    fingerprint = check_fingerprint(ds, inp.data_fingerprint, repr(cfg.path))
    idx = list(range(min(cfg.num_prompts, len(ds))))
    batch = build_file_prompts(ds, ds.entries(idx), tok, data=data, processor=processor,
                               id_prefix=f"{HELDOUT_PREFIX}-{ds.name}")
    return batch, {"eval_path": cfg.path, "dataset_rows": len(ds), "dataset_indices": idx,
                   "rows": [ds.where(i) for i in idx], "data_fingerprint": fingerprint}


def greedy_generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int,
                    images: list[list[bytes]] | None = None, videos: list[list[bytes]] | None = None,
                    processor=None) -> list[Generation]:
    """One greedy (argmax) response per prompt, in micro-batches of left-padded prompts in input
    order: the rollout engine's batch path (``HFEngine.generate(..., greedy=True)``), so a
    vision-language policy's images and videos go with every batch as in training.

    Args:
        prompts: token ids of each prompt (chat template applied, no padding).
        images, videos, processor: a vision-language policy's per-prompt media (encoded bytes,
            one list per prompt) and its ``VLProcessor`` (None: a text-only policy).
    Returns:
        len(prompts) generations in input order (``sample_index`` 0); ``response_token_ids`` end
        at the first EOS (kept), ``logprobs`` are float32 log-softmax values of the chosen
        tokens at temperature 1, ``finish_reason`` "stop" or "length".
    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` < 1, or media without a processor.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    engine = HFEngine(model, tokenizer)
    return engine.generate(prompts, n_samples_per_prompt=1, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           sort_by_length=False, share_prefill=False, greedy=True, images=images, videos=videos,
                           processor=processor)


def sample_generate(model, tokenizer, prompts: list[list[int]], *, n_samples: int, temperature: float, top_p: float,
                    seed: int, max_new_tokens: int, batch_size: int, images: list[list[bytes]] | None = None,
                    videos: list[list[bytes]] | None = None, processor=None) -> list[Generation]:
    """``n_samples`` sampled responses per prompt: the rollout engine's sampling path
    (``HFEngine.generate`` with its default batching, as a training rollout samples), each batch
    seeded from ``seed`` so a rerun gives the same responses on the same hardware.

    Args:
        prompts, images, videos, processor: as ``greedy_generate``.
        temperature: > 0; top_p: nucleus in (0, 1].
    Returns:
        len(prompts) * n_samples generations grouped by prompt in input order (``sample_index``
        0..n-1); ``logprobs`` are float32 log-probs under the distribution each token was sampled
        from (temperature and nucleus applied).
    Raises:
        ValueError: ``n_samples``, ``max_new_tokens`` or ``batch_size`` < 1, or ``temperature`` <= 0.
    """
    if n_samples < 1 or max_new_tokens < 1 or batch_size < 1 or not temperature > 0:
        raise ValueError(f"n_samples, max_new_tokens, batch_size must be >= 1 and temperature > 0, got {n_samples}, "
                         f"{max_new_tokens}, {batch_size}, {temperature}")
    engine = HFEngine(model, tokenizer)
    return engine.generate(prompts, n_samples_per_prompt=n_samples, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, batch_size=batch_size, seed=seed, images=images,
                           videos=videos, processor=processor)


@stage_program(EvalGenerateInput)
def run_generate(inp: EvalGenerateInput) -> ShardRef:
    """Greedy-decode one response per held-out prompt with ``policy`` on ``default_device()``
    (``temperature`` None), or sample ``n_samples`` responses per prompt at ``temperature`` and
    ``top_p`` with ``seed`` (``sample_generate``); writes a single-turn `rollout` shard
    (sample_id ``{prompt_id}#{sample_index}``; no environment, also when the run trained with
    ``rollout.agent``) whose rows carry their prompt's images and videos. A vision-language
    policy gets them with every batch (its processor loaded from the model folder, as in
    training). The summary holds seconds, generated tokens, tokens/second and the decoding
    (``greedy``, or ``sampled`` with n_samples, temperature, top_p, seed).

    Raises:
        StaleShardError: ``out`` is committed with another config.
        rft_core.models.vl.VLError: a prompt's media do not match its tokens (another processor).
    """
    commit = stage_commit(inp)
    prompts, policy, max_new_tokens, batch_size = inp.prompts, inp.policy, inp.max_new_tokens, inp.batch_size

    def compute() -> ShardRef:
        table = read_shard(prompts, stage="prompts")
        path = policy_model_path(policy)
        processor = vl_processor_or_none(path)
        tok = load_tokenizer(path)
        model = load_causal_lm(path, dtype=inp.dtype).to(default_device())
        model.eval()
        prompt_ids = table.column("prompt_token_ids").to_pylist()
        images, videos = table.column("images").to_pylist(), table.column("videos").to_pylist()
        media = {"images": images, "videos": videos, "processor": processor} if processor is not None else {}
        if processor is None and (any(images) or any(videos)):
            raise ValueError(f"{prompts.uri}: prompts with images or videos, but {path} is a text-only model")
        with Timer() as t:
            if inp.temperature is None:
                gens = greedy_generate(model, tok, prompt_ids, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                       **media)
            else:
                gens = sample_generate(model, tok, prompt_ids, n_samples=inp.n_samples, temperature=inp.temperature,
                                       top_p=inp.top_p, seed=inp.seed, max_new_tokens=max_new_tokens,
                                       batch_size=batch_size, **media)
        pids = table.column("prompt_id").to_pylist()
        responses = [g.response_token_ids for g in gens]
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        rows = {
            "sample_id": [f"{pids[g.prompt_index]}#{g.sample_index}" for g in gens],
            "prompt_id": [pids[g.prompt_index] for g in gens],
            "sample_index": [g.sample_index for g in gens],
            "prompt_token_ids": [prompt_ids[g.prompt_index] for g in gens],
            "response_token_ids": responses,
            "response_text": texts,
            "rollout_logprobs": [g.logprobs for g in gens],
            "action_mask": [[True] * len(r) for r in responses],
            "finish_reason": [g.finish_reason for g in gens],
            "images": [images[g.prompt_index] for g in gens],
            "videos": [videos[g.prompt_index] for g in gens],
            **single_turn_columns(texts),  # single-turn (also for an agent run's checkpoints)
            **policy_version_column(len(texts), None),  # not a training rollout
        }
        table_out = pa.table(rows, schema=ROLLOUT.arrow)
        n_tokens = sum(len(r) for r in responses)
        decoding = {"decoding": "greedy"} if inp.temperature is None else {
            "decoding": "sampled", "n_samples": inp.n_samples, "temperature": inp.temperature, "top_p": inp.top_p,
            "seed": inp.seed}
        summary = {"seconds": t.seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(t.seconds, 1e-9),
                   **decoding, "policy": checkpoint_label(policy), **rollout_summary(table_out)}
        return commit.write(table_out, schema=ROLLOUT, inputs={"prompts": prompts}, summary=summary)

    return reuse_or_compute(commit, compute)


def eval_summary(table: pa.Table) -> dict[str, Any]:
    """Accuracy, mean reward and their standard errors over the rows of an `eval` table.

    accuracy = mean(correct); accuracy_stderr = sqrt(acc * (1 - acc) / n) (binomial);
    reward_stderr = sample std (ddof 1) / sqrt(n). Also the mean response length (tokens) and the
    fraction of responses cut at max_new_tokens.

    Raises:
        ValueError: an empty table.
    """
    n = table.num_rows
    if n == 0:
        raise ValueError("eval table has no rows")
    correct = table.column("correct").to_pylist()
    rewards = [float(r) for r in table.column("rewards").to_pylist()]
    acc = sum(correct) / n
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    return {"num_prompts": n, "accuracy": acc, "accuracy_stderr": math.sqrt(acc * (1 - acc) / n),
            "reward_mean": mean, "reward_stderr": math.sqrt(var / n),
            "response_length_mean": float(pc.mean(table.column("response_length")).as_py()),
            "truncated_fraction": sum(f == "length" for f in table.column("finish_reason").to_pylist()) / n}


def sampled_eval_summary(table: pa.Table, *, n_samples: int) -> dict[str, Any]:
    """The summary of a sampled `eval` table (columns ``data_source`` and ``sample_index``
    present): ``num_prompts`` (prompts, not rows), ``num_samples`` (rows), ``n_samples``;
    ``accuracy`` = avg@n and ``reward_mean`` = the mean reward of the rows (equal to the mean of
    the per-prompt means), each with its standard error across prompts (sd of the per-prompt
    means, ddof 1, / sqrt(prompts): the answers of one prompt are not independent, so the
    greedy summary's binomial error over rows would be too small); the mean response length and
    the fraction cut at max_new_tokens over rows; and ``metrics``:
    ``rft_core.evaluation.metrics.sampled_metrics`` (avg@n, pass@1..n, maj@n with standard
    errors, ``overall`` and ``by_data_source``).

    Raises:
        ValueError: an empty table, or a prompt without exactly ``n_samples`` rows (naming it).
    """
    if table.num_rows == 0:
        raise ValueError("eval table has no rows")
    rows = table.select(["prompt_id", "data_source", "sample_index", "correct", "extracted_answer", "rewards"]).to_pylist()
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    for pid, group in by_prompt.items():
        if sorted(r["sample_index"] for r in group) != list(range(n_samples)):
            raise ValueError(f"prompt {pid!r} has responses {sorted(r['sample_index'] for r in group)}, expected sample "
                             f"indices 0..{n_samples - 1}")
    groups = [sorted(g, key=lambda r: r["sample_index"]) for g in by_prompt.values()]
    answers = [PromptAnswers(g[0]["data_source"], tuple(bool(r["correct"]) for r in g),
                             tuple(r["extracted_answer"] for r in g)) for g in groups]
    metrics = sampled_metrics(answers)
    reward_mean, reward_stderr = mean_stderr([math.fsum(float(r["rewards"]) for r in g) / n_samples for g in groups])
    overall = metrics["overall"]
    return {"num_prompts": len(groups), "num_samples": table.num_rows, "n_samples": n_samples,
            "accuracy": overall[f"avg@{n_samples}"], "accuracy_stderr": overall[f"avg@{n_samples}_stderr"],
            "reward_mean": reward_mean, "reward_stderr": reward_stderr,
            "response_length_mean": float(pc.mean(table.column("response_length")).as_py()),
            "truncated_fraction": sum(f == "length" for f in table.column("finish_reason").to_pylist()) / table.num_rows,
            "metrics": metrics}


@stage_program(EvalSummaryInput)
def run_summary(inp: EvalSummaryInput) -> ShardRef:
    """Join prompts, responses and rewards per sample into an `eval` shard; the manifest
    summary holds ``eval_summary`` plus the checkpoint evaluated. Sampled responses
    (``inp.sampled``) also get each row's ``data_source`` and ``sample_index`` (optional
    columns of the `eval` schema) and ``sampled_eval_summary`` with the decoding settings of
    the rollout (temperature, top_p, seed).

    Raises:
        ShardSchemaError: a rollout or rewards sample without a matching prompt or reward.
        ValueError: (sampled) a prompt without exactly ``n_samples`` responses.
        StaleShardError: ``out`` is committed with another config.
    """
    commit = stage_commit(inp)
    prompts, rollout, rewards, policy = inp.prompts, inp.rollout, inp.rewards, inp.policy

    def compute() -> ShardRef:
        p = {r["prompt_id"]: r for r in read_shard(prompts, stage="prompts").to_pylist()}
        r = read_shard(rollout, stage="rollout")
        w = read_shard(rewards, stage="rewards")
        by_sample = dict(zip(w.column("sample_id").to_pylist(),
                             zip(w.column("rewards").to_pylist(), w.column("correct").to_pylist(),
                                 w.column("extracted_answer").to_pylist())))
        extra = ["data_source", "sample_index"] if inp.sampled else []
        schema = EVAL.arrow_with(extra)
        rows: dict[str, list] = {f.name: [] for f in schema}
        for sid, pid, k, text, toks, finish in zip(
                r.column("sample_id").to_pylist(), r.column("prompt_id").to_pylist(),
                r.column("sample_index").to_pylist(), r.column("response_text").to_pylist(),
                r.column("response_token_ids").to_pylist(), r.column("finish_reason").to_pylist()):
            if pid not in p:
                raise ShardSchemaError(f"{rollout.uri}: prompt_id {pid!r} is not in {prompts.uri}")
            if sid not in by_sample:
                raise ShardSchemaError(f"{rollout.uri}: sample_id {sid!r} has no row in {rewards.uri}")
            reward, correct, extracted = by_sample[sid]
            for key, v in (("sample_id", sid), ("prompt_id", pid), ("question", p[pid]["question"]),
                           ("answer", p[pid]["answer"]), ("response_text", text), ("extracted_answer", extracted),
                           ("rewards", reward), ("correct", correct), ("response_length", len(toks)),
                           ("finish_reason", finish), ("data_source", p[pid]["data_source"]), ("sample_index", k)):
                if key in rows:
                    rows[key].append(v)
        table = pa.table(rows, schema=schema)
        gen_summary = read_manifest(rollout.uri)[0].summary
        if inp.sampled:
            decoding = {k: gen_summary.get(k) for k in ("decoding", "temperature", "top_p", "seed")}
            head = {**sampled_eval_summary(table, n_samples=inp.n_samples), **decoding}
        else:
            head = eval_summary(table)
        summary = {**head, "policy": checkpoint_label(policy),
                   "generate_seconds": gen_summary.get("seconds"), "tokens_per_second": gen_summary.get("tokens_per_second")}
        return commit.write(table, schema=EVAL, inputs={"prompts": prompts, "rollout": rollout, "rewards": rewards},
                            summary=summary)

    return reuse_or_compute(commit, compute)


def _se(se: float | None) -> str:
    return "n/a" if se is None else f"{se:.3f}"


def _pm(summary: dict[str, Any], name: str) -> str:
    """``"0.417 ± 0.120"`` of metric ``name`` in a metrics block (``± n/a`` for one prompt)."""
    return f"{summary[name]:.3f} ± {_se(summary.get(f'{name}_stderr'))}"


def eval_report_lines(summary: dict[str, Any]) -> list[str]:
    """The lines ``rft eval`` prints for a sampled evaluation (an `eval` manifest summary with
    ``metrics``): the decoding, avg@n, pass@k (every k up to 16, else powers of two and n:
    ``shown_ks``; the manifest holds every k) and maj@n with standard errors across prompts,
    then the same per data_source when there are several. Empty for a greedy summary."""
    if "metrics" not in summary:
        return []
    n, overall, by_source = summary["n_samples"], summary["metrics"]["overall"], summary["metrics"]["by_data_source"]
    lines = [f"decoding:    sampled, {n} answers per prompt (temperature {summary.get('temperature')}, top-p "
             f"{summary.get('top_p')}, seed {summary.get('seed')}); {summary['num_prompts']} held-out prompts",
             f"{f'avg@{n}:':<12} {_pm(overall, f'avg@{n}')}"]
    lines += [f"{f'pass@{k}:':<12} {_pm(overall, f'pass@{k}')}" for k in shown_ks(n)]
    lines.append(f"{f'maj@{n}:':<12} {_pm(overall, f'maj@{n}')}")
    if len(by_source) > 1:
        lines.append("by data_source:")
        for src, block in by_source.items():
            lines.append(f"  {src} ({block['num_prompts']} prompts): avg@{n} {_pm(block, f'avg@{n}')} · pass@{n} "
                         f"{_pm(block, f'pass@{n}')} · maj@{n} {_pm(block, f'maj@{n}')}")
    lines.append("(± standard errors across prompts; pass@k: the unbiased estimator of Chen et al. 2021)")
    return lines


def eval_markdown(table: pa.Table, summary: dict[str, Any], *, n: int = 10, width: int = 160) -> str:
    """Markdown of an evaluation: the summary line, for sampled answers a table of avg@n,
    pass@k (``shown_ks``) and maj@n ± standard error overall and per data_source, and the first
    ``n`` samples."""
    def cell(v: Any) -> str:
        text = "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= width else text[: width - 1] + "…"

    if "metrics" not in summary:
        head = (f"### Held-out evaluation of `{summary.get('policy')}`\n\n"
                f"accuracy **{summary['accuracy']:.3f}** ± {summary['accuracy_stderr']:.3f} · mean reward "
                f"**{summary['reward_mean']:.3f}** ± {summary['reward_stderr']:.3f} · {summary['num_prompts']} prompts, greedy · "
                f"mean length {summary['response_length_mean']:.1f} tokens · truncated {summary['truncated_fraction']:.2f}\n")
    else:
        k_n = summary["n_samples"]
        names = [f"avg@{k_n}", *(f"pass@{k}" for k in shown_ks(k_n)), f"maj@{k_n}"]
        blocks = {"overall": summary["metrics"]["overall"], **summary["metrics"]["by_data_source"]}
        table_md = ["| data_source | prompts | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
        table_md += [f"| {cell(src)} | {b['num_prompts']} | " + " | ".join(_pm(b, m) for m in names) + " |"
                     for src, b in blocks.items()]
        head = (f"### Held-out evaluation of `{summary.get('policy')}`\n\n"
                f"{summary['num_prompts']} prompts × {k_n} sampled answers (temperature {summary.get('temperature')}, "
                f"top-p {summary.get('top_p')}, seed {summary.get('seed')}) · mean reward "
                f"**{summary['reward_mean']:.3f}** ± {_se(summary['reward_stderr'])} · mean length "
                f"{summary['response_length_mean']:.1f} tokens · truncated {summary['truncated_fraction']:.2f}\n\n"
                + "\n".join(table_md) + "\n\n± standard errors across prompts; pass@k: the unbiased estimator of "
                "Chen et al. 2021 (arXiv:2107.03374); maj@n: majority vote, ties split\n")
    cols = ["question", "answer", "response_text", "extracted_answer", "rewards", "correct"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(row[c]) for c in cols) + " |" for row in table.slice(0, n).to_pylist()]
    return head + "\n" + "\n".join(lines)


def default_eval_root(policy: PolicyRef, *, fingerprint: str, base: str = "runs/eval") -> str:
    """Where an evaluation writes its stages when no folder is given.

    A checkpoint of a run (``{run}/iter=000012/ppo_update``) is evaluated into
    ``{run}/eval/iter=000012-{fingerprint}``; a model path into ``{base}/{name}-{fingerprint}``
    (made absolute when local). ``fingerprint`` (a config hash of the evaluation settings) keeps
    evaluations with other settings apart, and makes a rerun reuse the committed stages.
    """
    if isinstance(policy, ShardRef) and "/iter=" in policy.uri:
        run_root, rest = policy.uri.rsplit("/iter=", 1)
        return f"{run_root}/eval/iter={rest.split('/', 1)[0]}-{fingerprint}"
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in checkpoint_label(policy).rstrip("/").rsplit("/", 1)[-1])
    root = f"{base.rstrip('/')}/{name}-{fingerprint}"
    return root if "://" in root else fsspec.core.url_to_fs(root)[1]
