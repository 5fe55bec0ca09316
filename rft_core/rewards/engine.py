"""The reward engine: named sources combined by per-label recipes (LightRFT's reward recipes).

For each sample the engine picks the recipe of its label (``reward.recipes[label]``, else
``reward.default_recipe``), sends each source only the samples whose recipe names it, checks
what came back, and combines:

    reward_i = sum_k w_k * score_k(i)        (``aggregation: weighted_sum``)

or ``fn(scores, weights, sample)`` for ``aggregation: "module:function"``.

Bad input never turns into a silent zero. A source that raises, returns the wrong number of
scores, marks a sample as failed, or returns NaN/inf either stops the stage with a
``RewardError`` naming the source and sample (``on_error: raise``, the default) or gives the
sample the source's ``fallback`` score, records ``reward_metrics['<source>.fallback'] = 1`` and
the reason in ``reward_reasons``, and counts it in the stage summary (``on_error: fallback``).
A source whose service is down (``SourceUnavailableError``: the llm_judge's endpoint) always
stops the stage. A label without a recipe is an error unless ``default_recipe`` is set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rft_core.rewards.base import REWARD_SOURCES, RewardError, RewardSample, SourceScore, SourceUnavailableError
from rft_core.rewards.code import CodeExecReward
from rft_core.rewards.environment import EnvironmentReward
from rft_core.rewards.judge import LLMJudgeReward
from rft_core.rewards.math import ExactMatchReward, FormatReward, MathAnswerReward
from rft_core.rewards.model import RewardModelReward
from rft_core.rewards.remote import RemoteReward
from rft_core.rewards.user import PythonReward, load_function

for _name, _cls in (("math_answer", MathAnswerReward), ("exact_match", ExactMatchReward), ("format", FormatReward), ("code_exec", CodeExecReward),
                    ("reward_model", RewardModelReward), ("remote", RemoteReward), ("python", PythonReward),
                    ("environment", EnvironmentReward), ("llm_judge", LLMJudgeReward)):
    if _name not in REWARD_SOURCES:
        REWARD_SOURCES.register(_name)(_cls)


@dataclass(frozen=True)
class SampleReward:
    """The combined reward of one sample and why.

    Attributes:
        reward: float, the aggregated reward.
        correct: True when at least one source of its recipe judges correctness and all such
            sources say correct.
        extracted: the first answer a source extracted (recipe order), else None.
        metrics: ``{source: score, 'source.extra': value, 'source.fallback': 1.0}``.
        reasons: ``{source: reason}`` for scores that were not a plain pass.
        recipe: the recipe name used.
        verdicts: the verdicts of the recipe's sources that store one (``SourceScore.record``,
            the llm_judge's), in recipe order; [] when none does.
    """

    reward: float
    correct: bool
    extracted: str | None
    metrics: dict[str, float]
    reasons: dict[str, str]
    recipe: str
    verdicts: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RewardBatch:
    """Results in sample order, plus per-source counts for the stage summary."""

    results: list[SampleReward]
    source_stats: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def fallbacks(self) -> int:
        """Number of (sample, source) scores that were replaced by a fallback."""
        return int(sum(s["fallbacks"] for s in self.source_stats.values()))


class RewardEngine:
    """Builds the configured sources once and scores batches of samples.

    Args:
        cfg: ``rft_core.config.RewardConfig`` (the shorthand keys are expanded).
        cache_root: a folder URI on the run's storage, given to the sources that keep state
            across stage attempts (a factory with ``uses_cache_root``: the llm_judge's stored
            verdicts); None: they keep nothing.
    Raises:
        RewardError: a user function or aggregation cannot be imported.
    """

    def __init__(self, cfg, *, cache_root: str | None = None) -> None:
        self.cfg = cfg.resolved
        self.sources = {name: _build_source(sc, name, cache_root) for name, sc in self.cfg.sources.items()}
        self.aggregate: Callable[..., Any] | None = (None if self.cfg.aggregation == "weighted_sum"
                                                      else load_function(self.cfg.aggregation))

    def recipe_name(self, label: str) -> str:
        """The recipe a label uses.

        Raises:
            RewardError: no recipe for ``label`` and no default recipe.
        """
        if label in self.cfg.recipes:
            return label
        if self.cfg.default_recipe is not None:
            return self.cfg.default_recipe
        raise RewardError(f"no reward recipe for label {label!r}; recipes: {', '.join(self.cfg.recipes)} "
                          "(add one under reward.recipes or set reward.default_recipe)")

    def _source_scores(self, name: str, samples: Sequence[RewardSample]) -> list[SourceScore]:
        src_cfg = self.cfg.sources[name]
        try:
            scores = list(self.sources[name].score(samples))
            if len(scores) != len(samples):
                raise RewardError(f"returned {len(scores)} scores for {len(samples)} samples")
        except SourceUnavailableError:
            raise  # never a fallback: the stage fails and its retry resumes
        except Exception as exc:  # noqa: BLE001 - applied per the source's on_error policy
            msg = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RewardError) else str(exc)
            if src_cfg.on_error == "raise":
                raise RewardError(f"reward source {name!r} failed on {len(samples)} samples "
                                  f"(first {samples[0].sample_id}): {msg}") from exc
            return [SourceScore(float("nan"), error=msg) for _ in samples]
        return scores

    def score(self, samples: Sequence[RewardSample]) -> RewardBatch:
        """Score ``samples`` (any mix of labels); results keep their order.

        Raises:
            RewardError: see the module docstring.
        """
        missing = sorted({s.label for s in samples if s.label not in self.cfg.recipes} if self.cfg.default_recipe is None else set())
        if missing:
            raise RewardError(f"no reward recipe for label(s) {missing}; recipes: {', '.join(self.cfg.recipes)} "
                              "(add them under reward.recipes or set reward.default_recipe)")
        recipes = [self.recipe_name(s.label) for s in samples]
        per_sample: list[dict[str, SourceScore]] = [{} for _ in samples]
        stats: dict[str, dict[str, float]] = {}
        for name in self.sources:
            idx = [i for i, r in enumerate(recipes) if any(item.source == name for item in self.cfg.recipes[r])]
            if not idx:
                continue
            src_cfg = self.cfg.sources[name]
            scores = self._source_scores(name, [samples[i] for i in idx])
            fallbacks, total = 0, 0.0
            for i, sc in zip(idx, scores):
                bad = sc.error or (None if _finite(sc.score) else f"returned {sc.score!r}, not a finite number")
                if bad:
                    if src_cfg.on_error == "raise":
                        raise RewardError(f"reward source {name!r} on sample {samples[i].sample_id}: {bad}")
                    fallbacks += 1
                    sc = SourceScore(src_cfg.fallback, None, None, f"fallback {src_cfg.fallback:g}: {bad}"[:500],
                                     {"fallback": 1.0}, record=sc.record)
                per_sample[i][name] = sc
                total += sc.score
            stats[name] = {"n": float(len(idx)), "mean": total / len(idx), "fallbacks": float(fallbacks),
                           **getattr(self.sources[name], "last_stats", {})}
        return RewardBatch([self._combine(s, recipes[i], per_sample[i]) for i, s in enumerate(samples)], stats)

    def _combine(self, sample: RewardSample, recipe: str, scores: dict[str, SourceScore]) -> SampleReward:
        items = self.cfg.recipes[recipe]
        weights: dict[str, float] = {}
        for item in items:
            weights[item.source] = weights.get(item.source, 0.0) + item.weight
        values = {name: scores[name].score for name in weights}
        if self.aggregate is None:
            reward = math.fsum(weights[n] * values[n] for n in weights)
        else:
            try:
                reward = self.aggregate(dict(values), dict(weights), sample)
            except Exception as exc:
                raise RewardError(f"reward aggregation {self.cfg.aggregation!r} failed on sample {sample.sample_id}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if not _finite(reward):
            raise RewardError(f"reward of sample {sample.sample_id} is {reward!r} (recipe {recipe!r}, scores {values})")
        judged = [scores[n].correct for n in weights if scores[n].correct is not None]
        extracted = next((scores[n].extracted for n in weights if scores[n].extracted is not None), None)
        metrics: dict[str, float] = {}
        reasons: dict[str, str] = {}
        for n in weights:
            sc = scores[n]
            metrics[n] = float(sc.score)
            metrics.update({f"{n}.{k}": float(v) for k, v in sc.extras.items()})
            if sc.reason:
                reasons[n] = sc.reason
        verdicts = [scores[n].record for n in weights if scores[n].record is not None]
        return SampleReward(float(reward), bool(judged) and all(judged), extracted, metrics, reasons, recipe, verdicts)


def _build_source(sc, name: str, cache_root: str | None):
    """The source object of config ``sc``: ``REWARD_SOURCES[sc.type](sc, name)``, plus
    ``cache_root=`` for a factory that declares ``uses_cache_root``."""
    factory = REWARD_SOURCES[sc.type]
    if getattr(factory, "uses_cache_root", False):
        return factory(sc, name, cache_root=cache_root)
    return factory(sc, name)


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x)) and not isinstance(x, bool)
    except (TypeError, ValueError):
        return False
