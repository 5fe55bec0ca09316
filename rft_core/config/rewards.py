"""Reward engine configs: the sources (a tagged union on ``type``), recipes and aggregation
(``rft_core.rewards``)."""
from __future__ import annotations

import re
import string
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rft_core.config._base import _Frozen, _tagged_union


class _RewardSourceBase(_Frozen):
    # what the source reads from each dataset row (``needs_reference``, ``reference_as_text``,
    # ``metadata_fields``), so the whole dataset can be checked before training
    # (``rft_core.data.validate``); the flows pass ``RewardConfig.needs_reference`` to the prompts stages
    needs_reference: ClassVar[bool] = False  # grades against the row's reference answer: a row must have one
    # stores a verdict per sample in the rewards shard (``judge_verdicts``; the llm_judge)
    stores_verdicts: ClassVar[bool] = False
    # fields outside the config hash (``rft_core.stages.contracts.hash_value``): how to reach a
    # service, never what it computes
    unhashed: ClassVar[frozenset[str]] = frozenset()
    reference_as_text: ClassVar[bool] = False  # ... compared as text: text, a number, a bool or chat messages
    metadata_fields: ClassVar[tuple[str, ...]] = ()  # columns it reads from the row's metadata (non-null text)
    on_error: Literal["raise", "fallback"] = Field(
        "raise", description="a source that raises or returns NaN/inf: stop the stage (raise) or give the "
        "sample `fallback` and count it in reward_metrics['<source>.fallback']")
    fallback: float = 0.0


def _http_url(v: str, key: str) -> str:
    """``v`` when it is an http(s) URL.

    Raises:
        ValueError: another scheme, or none; the message names ``key``.
    """
    if not v.startswith(("http://", "https://")):
        raise ValueError(f"{key} must start with http:// or https://, got {v!r}")
    return v


class MathAnswerSource(_RewardSourceBase):
    """Correctness of the extracted final answer: the dataset's grader or math-verify."""

    type: Literal["math_answer"] = "math_answer"
    needs_reference: ClassVar[bool] = True
    reference_as_text: ClassVar[bool] = True
    grader: Literal["dataset", "math_verify"] = "dataset"
    timeout_s: float = Field(5.0, gt=0, description="math_verify: per-sample wall-time limit (a worker process is killed past it)")


class ExactMatchSource(_RewardSourceBase):
    """1.0 when the extracted final answer equals the reference (stripped; optionally ignoring case)."""

    type: Literal["exact_match"] = "exact_match"
    needs_reference: ClassVar[bool] = True
    reference_as_text: ClassVar[bool] = True
    ignore_case: bool = True


class FormatSource(_RewardSourceBase):
    """1.0 when the response gives its answer in an `Answer:` line or an <answer> tag."""

    type: Literal["format"] = "format"


class CodeExecSource(_RewardSourceBase):
    """Run the response against the problem's unit tests in a sandboxed subprocess."""

    type: Literal["code_exec"] = "code_exec"
    metadata_fields: ClassVar[tuple[str, ...]] = ("test", "entry_point")
    timeout_s: float = Field(5.0, gt=0, description="wall-time limit per sample (s)")
    memory_mb: int = Field(512, ge=64, description="address-space limit per sample (MiB)")
    max_workers: int | None = Field(None, gt=0, description="samples run at once (None: CPU count)")
    network: Literal["namespace", "audit"] = Field(
        "namespace", description="namespace: a network namespace (unshare) plus the audit hook; audit: the audit hook only")


class RewardModelSource(_RewardSourceBase):
    """A local HF sequence-classification model; score = logit 0 of prompt+response."""

    type: Literal["reward_model"] = "reward_model"
    path: str
    batch_size: int = Field(8, gt=0)
    max_length: int = Field(1024, gt=0, description="tokens; longer inputs keep their end")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"


class RemoteSource(_RewardSourceBase):
    """A remote reward model: POST {queries, prompts, labels, references} -> {rewards}."""

    type: Literal["remote"] = "remote"
    needs_reference: ClassVar[bool] = True  # sent as `references`: the server may grade against them
    url: str
    timeout_s: float = Field(30.0, gt=0, description="connect and read timeout per request (s)")
    retries: int = Field(3, ge=0, description="retries on connection errors, timeouts and HTTP 429/5xx")
    backoff_s: float = Field(0.5, ge=0, description="backoff factor: waits backoff_s * 2**(n-1) before retry n")
    batch_size: int = Field(64, gt=0, description="samples per request")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        return _http_url(v, "url")


class PythonSource(_RewardSourceBase):
    """A user's function, given as `module:function` or `path/to/file.py:function`."""

    type: Literal["python"] = "python"
    needs_reference: ClassVar[bool] = True  # the function gets `sample.reference` and may grade against it
    function: str
    call: Literal["sample", "batch", "lightrft"] = Field(
        "sample", description="sample: fn(sample) -> float | (float, reason); batch: fn(samples) -> list; "
        "lightrft: fn(queries, prompts, labels) -> list")

    @field_validator("function")
    @classmethod
    def _spec(cls, v: str) -> str:
        if ":" not in v or not v.rsplit(":", 1)[1].isidentifier():
            raise ValueError(f"function must be 'module:function' or 'path/to/file.py:function', got {v!r}")
        return v


class EnvironmentSource(_RewardSourceBase):
    """The multi-turn environment's reward of each trajectory (the sum of its step rewards, the
    rollout's ``env_reward``; ``rollout.agent``, docs/agents.md). A sample of a single-turn
    rollout (no environment) is an error, handled by ``on_error``."""

    type: Literal["environment"] = "environment"


# The fields a judge template may name, each filled from the sample (``RewardSample``): the
# dataset's raw question, the policy's decoded response, the row's reference answer.
JUDGE_PLACEHOLDERS = ("question", "response", "reference")

# The default rubric of ``llm_judge`` (``template`` unset): a reference-guided correctness grade
# on a 0-10 scale ending in a ``Score: N`` line, which the default parse rule reads (number in
# [0, 10], scaled to [0, 1]). Modelled on the reference-guided single-answer grading prompt of
# MT-Bench (Zheng et al. 2023, "Judging LLM-as-a-Judge", fig. 10: explain, then "Rating: [[N]]"
# on 1-10) and verl's GenRM recipe (recipe/genrm_remote: question + solution, critique first,
# verdict last); the verdict line is plain text so that small judges produce it too.
DEFAULT_JUDGE_TEMPLATE = """You are grading a response to a question, using the reference answer as the ground truth.

[Question]
{question}

[Reference answer]
{reference}

[Response]
{response}

Judge whether the response answers the question correctly and completely. Ignore style and length; \
a response whose final answer disagrees with the reference answer is wrong. Explain your judgement \
in at most three sentences, then end with a line of the form "Score: N", where N is an integer from \
0 (wrong) to 10 (fully correct)."""

# ``parse: number`` without ``pattern``: the number after the last "Score:" / "score =" (any case;
# markdown bold around the colon allowed: "**Score:** 8"); "Score: 7/10" reads 7
DEFAULT_SCORE_PATTERN = r"(?i)\bscore\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)"


def template_fields(template: str) -> set[str]:
    """The placeholders of a judge template (``str.format`` fields: ``{question}``; ``{{`` and
    ``}}`` are literal braces).

    Raises:
        ValueError: a positional ``{}``, an attribute, index, conversion or format spec
            (``{question.x}``, ``{response!r}``, ``{question:>5}``), a placeholder that is not one of
            ``JUDGE_PLACEHOLDERS``, or unbalanced braces; the message names the placeholder.
    """
    fields: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"template: {exc} (write {{{{ and }}}} for literal braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in JUDGE_PLACEHOLDERS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"template has the placeholder {shown}; a template may use only "
                             f"{', '.join('{' + p + '}' for p in JUDGE_PLACEHOLDERS)} (write {{{{ and }}}} for literal braces)")
        fields.add(name)
    return fields


class LLMJudgeSource(_RewardSourceBase):
    """An LLM judge (generative reward model) behind an OpenAI-compatible chat-completions endpoint
    (vLLM, SGLang, llama.cpp's server, ``transformers serve``, hosted APIs), called with the official
    ``openai`` client; ``rft_core.rewards.judge`` says how a verdict is asked for, parsed, stored
    and cached. ``unhashed``: how to reach the judge, not what it answers (the fields stay out of
    the config hash, so a run resumes against a moved server or with another concurrency)."""

    type: Literal["llm_judge"] = "llm_judge"
    stores_verdicts: ClassVar[bool] = True
    unhashed: ClassVar[frozenset[str]] = frozenset({"base_url", "api_key_env", "max_concurrency", "timeout_s", "max_retries"})
    base_url: str = Field(description="the endpoint's OpenAI API root, e.g. http://judge-host:8000/v1")
    model: str = Field(description="the judge model's name on that endpoint (vLLM's --served-model-name)")
    template: str | None = Field(None, description="the user message, with {question}, {response}, {reference}; "
                                 "None: the default rubric (DEFAULT_JUDGE_TEMPLATE, docs/rewards.md)")
    system: str | None = Field(None, description="a system message before it (None: none)")
    parse: Literal["number", "label"] = Field(
        "number", description="number: the last match of `pattern` is a number in score_range; label: the last of "
        "the `labels` keys in the reply gives its value")
    pattern: str | None = Field(None, description="regex with one group: the score's text (None: number: after the "
                                "last 'Score:'; label: the last whole-word label, any case)")
    score_range: tuple[float, float] = Field((0.0, 10.0), description="parse: number: the accepted [low, high]")
    normalize: bool = Field(True, description="parse: number: score = (x - low) / (high - low), in [0, 1]")
    labels: dict[str, float] = Field(default_factory=dict, description="parse: label: label -> score, e.g. "
                                     "{CORRECT: 1.0, INCORRECT: 0.0}")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature (0: greedy)")
    top_p: float | None = Field(None, gt=0, le=1, description="None: not sent (the endpoint's default)")
    max_tokens: int = Field(512, gt=0, description="tokens the judge may write per verdict")
    seed: int | None = Field(0, description="sent with every request (seeded sampling where the endpoint "
                             "supports it: vLLM, SGLang, llama.cpp, OpenAI); None: not sent")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="the environment variable holding the API key; "
                                    "None: no key (a local server), 'EMPTY' is sent")
    max_concurrency: int = Field(32, gt=0, description="requests in flight at once")
    timeout_s: float = Field(60.0, gt=0, description="per request (s)")
    max_retries: int = Field(3, ge=0, description="the openai client's retries (exponential backoff with jitter) on "
                             "connection errors, timeouts, 408, 409, 429 and 5xx")

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        """True when the template reads ``{reference}`` (the default rubric does)."""
        return "reference" in template_fields(self.effective_template)

    @property
    def effective_template(self) -> str:
        """``template``, or the default rubric when it is None."""
        return DEFAULT_JUDGE_TEMPLATE if self.template is None else self.template

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        return _http_url(v, "base_url")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str | None) -> str | None:
        if v is not None:
            if not template_fields(v) & {"response"}:
                raise ValueError("template has no {response} placeholder: the judge would never see the response")
        return v

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                groups = re.compile(v).groups
            except re.error as exc:
                raise ValueError(f"pattern {v!r} is not a regular expression: {exc}") from None
            if groups != 1:
                raise ValueError(f"pattern {v!r} has {groups} groups; it needs exactly one: the score's text")
        return v

    @model_validator(mode="after")
    def _parse_rule(self) -> "LLMJudgeSource":
        lo, hi = self.score_range
        if not lo < hi:
            raise ValueError(f"score_range [{lo:g}, {hi:g}] is empty: its low end must be below its high end")
        if self.parse == "label" and not self.labels:
            raise ValueError("parse: label needs labels (label -> score), e.g. {CORRECT: 1.0, INCORRECT: 0.0}")
        if self.parse == "number" and self.labels:
            raise ValueError("labels are read only with parse: label")
        if any(not k.strip() for k in self.labels):
            raise ValueError("labels has an empty label")
        lowered = [k.strip().lower() for k in self.labels]
        if len(set(lowered)) != len(lowered):
            raise ValueError(f"labels {sorted(self.labels)} differ only in case; labels are matched in any case")
        return self


REWARD_SOURCE_CONFIGS = (MathAnswerSource, ExactMatchSource, FormatSource, CodeExecSource, RewardModelSource, RemoteSource,
                         PythonSource, EnvironmentSource, LLMJudgeSource)
RewardSourceConfig = _tagged_union(REWARD_SOURCE_CONFIGS, "type", "math_answer", "reward source type")


class RecipeItem(_Frozen):
    """One term of a recipe: ``weight`` times the score of the named source. A weight of 0 still
    computes and logs the score; leave the item out to skip the source."""

    source: str
    weight: float = 1.0


class RewardConfig(_Frozen):
    """The reward engine: named sources, and per-label recipes that weight them.

    With ``sources`` left empty the shorthand keys build the implicit recipe
    ``correct_reward * correctness + format_reward * format`` for every label.
    """

    grader: Literal["dataset", "math_verify"] = "dataset"
    correct_reward: float = 1.0
    format_reward: float = Field(0.0, description="added when the response ends with an 'Answer:' line or <answer> tag")
    sources: dict[str, RewardSourceConfig] = Field(default_factory=dict, description="name -> source")
    recipes: dict[str, list[RecipeItem]] = Field(default_factory=dict, description="label -> [(source, weight)]")
    label_field: Literal["data_source"] = Field("data_source", description="the prompt column that picks a sample's recipe")
    default_recipe: str | None = Field(None, description="recipe for labels that have none (None: such a label is an error)")
    aggregation: str = Field("weighted_sum", description="weighted_sum, or 'module:function' called as fn(scores, weights, sample)")

    @model_validator(mode="after")
    def _check_recipes(self) -> "RewardConfig":
        if not self.sources:
            if self.recipes or self.default_recipe is not None:
                raise ValueError("reward.recipes need reward.sources")
            return self
        if (self.grader, self.correct_reward, self.format_reward) != ("dataset", 1.0, 0.0):
            raise ValueError("reward.grader/correct_reward/format_reward are shorthand for the implicit recipe; "
                             "with reward.sources set, give weights in reward.recipes instead")
        if not self.recipes:
            raise ValueError("reward.sources is set but reward.recipes is empty")
        for label, items in self.recipes.items():
            if not items:
                raise ValueError(f"reward.recipes.{label} is empty")
            for item in items:
                if item.source not in self.sources:
                    raise ValueError(f"reward.recipes.{label} uses source {item.source!r}, which is not in "
                                     f"reward.sources (defined: {', '.join(self.sources)})")
        if self.default_recipe is not None and self.default_recipe not in self.recipes:
            raise ValueError(f"reward.default_recipe {self.default_recipe!r} is not a recipe (defined: {', '.join(self.recipes)})")
        return self

    def used_sources(self) -> list[_RewardSourceBase]:
        """The sources some recipe uses (of the ``resolved`` config), in definition order."""
        cfg = self.resolved
        used = {item.source for items in cfg.recipes.values() for item in items}
        return [src for name, src in cfg.sources.items() if name in used]

    @property
    def needs_reference(self) -> bool:
        """True when a source some recipe uses grades against the row's reference answer
        (``math_answer``, ``exact_match``, ``remote``, ``python``, an ``llm_judge`` whose template
        shows ``{reference}``, as the default rubric does); False when every used source reads no
        answer (``format``, ``code_exec``, ``reward_model``, ``environment``), so rows without an
        answer are accepted (their reference is empty text)."""
        return any(src.needs_reference for src in self.used_sources())

    @property
    def resolved(self) -> "RewardConfig":
        """This config with the shorthand expanded into explicit sources and one default recipe."""
        if self.sources:
            return self
        sources = {"correctness": MathAnswerSource(grader=self.grader), "format": FormatSource()}
        recipe = [RecipeItem(source="correctness", weight=self.correct_reward),
                  RecipeItem(source="format", weight=self.format_reward)]  # weight 0: still logged
        return RewardConfig.model_construct(
            grader="dataset", correct_reward=1.0, format_reward=0.0, sources=sources, recipes={"default": recipe},
            label_field="data_source", default_recipe="default", aggregation=self.aggregation)
