"""The reward-source contract: what a source gets (``RewardSample``) and returns (``SourceScore``).

A source scores a list of samples at once (so models batch and sandboxes run in parallel) and
returns one ``SourceScore`` per sample, in order. The engine (``rft_core.rewards.engine``) picks
which samples each source sees (only those whose recipe uses it), checks the count and the
values, applies each source's error policy and combines the scores by recipe.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from rft_core.registry import Registry


class RewardError(RuntimeError):
    """A reward source failed or broke its contract (wrong count, NaN/inf, bad reply); the
    message names the source, and the sample or URL involved."""


class SourceUnavailableError(RewardError):
    """A source cannot score anything now: the service behind it is unreachable, keeps failing
    after its retries, or refuses this client (missing or refused key, unknown model). Never
    replaced by a fallback, whatever the source's ``on_error``: a fallback would write an outage
    into the training data. The stage fails, so the Prefect task (or a rerun) retries it; the
    message names the source and the endpoint."""


@dataclass(frozen=True)
class RewardSample:
    """One response to grade.

    Attributes:
        sample_id, prompt_id: keys of the rollout shard.
        label: the recipe label (the prompt's ``data_source``, e.g. ``basic_arithmetic``, ``humaneval``).
        question: the raw question the dataset gave.
        prompt_text: the chat-templated prompt the policy saw.
        response: the decoded response text.
        reference: the ground truth of the prompt (``answer`` column).
        metadata: the dataset row's metadata (decoded ``metadata_json``): graders' extra fields,
            HumanEval's ``entry_point``/``test``/``prompt``.
        finish_reason: "stop" or "length".
        images: the prompt's encoded images (PNG/JPEG bytes; empty for text-only prompts), for
            vision-language reward functions and models.
        videos: the prompt's encoded videos (the container file's bytes, e.g. MP4; empty when
            the prompt has none); ``rft_core.data.video.decode_video`` turns one into frames.
        env_reward: a multi-turn trajectory's environment reward (the sum of its step rewards,
            the rollout's ``env_reward``); None when the rollout had no environment
            (``rollout.agent`` unset). ``response`` is then the LAST model turn's text.
        env_fallback: True when ``env_reward`` is ``rollout.agent.fallback_reward`` because the
            environment failed (``on_env_error: fallback``).
    """

    sample_id: str
    prompt_id: str
    label: str
    question: str
    prompt_text: str
    response: str
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    env_reward: float | None = None
    env_fallback: bool = False


@dataclass(frozen=True)
class SourceScore:
    """One source's verdict on one sample.

    Attributes:
        score: float, the source's reward (unweighted).
        correct: True/False when the source judges correctness (answers, unit tests), else None.
        extracted: the answer the source graded, when it extracts one.
        reason: why, when not a plain pass (``timeout after 5.0 s``, ``AssertionError``, ...).
        extras: further numbers stored as ``reward_metrics['<source>.<key>']``.
        error: set when the source failed on this sample (``score`` is then ignored); the
            engine raises or falls back per the source's ``on_error``.
        record: the verdict to store with the sample in the rewards shard (a source whose
            config has ``stores_verdicts``, the llm_judge: ``schemas.columns.JUDGE_VERDICT``'s
            fields), kept when the score falls back; None for the other sources.
    """

    score: float
    correct: bool | None = None
    extracted: str | None = None
    reason: str | None = None
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    record: dict[str, Any] | None = None


class RewardSource(Protocol):
    """Scores a batch of samples: ``score(samples)`` returns one ``SourceScore`` per sample,
    in order. May raise; the engine applies the source's ``on_error`` policy
    (``SourceUnavailableError`` always stops the stage).

    Optional: ``last_stats`` (``dict[str, float]``, counts of its last ``score`` call, merged
    into the stage summary's ``reward_sources[name]``); a factory with ``uses_cache_root = True``
    is also given ``cache_root=`` (a folder URI on the run's storage for what it keeps across
    stage attempts, or None: keep nothing)."""

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]: ...


# type name (the config's `type`) -> factory(config, name) -> RewardSource
REWARD_SOURCES: Registry[Callable[..., RewardSource]] = Registry("reward source type")
