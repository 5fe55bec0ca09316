"""The multi-turn rollout loop, token in, token out.

Per round, every active trajectory (prompt + everything after it so far, as token ids) is
generated one turn with ``model.generate`` (left-padded batches of ``batch_size``, KV cache on),
until EOS, one of its environment's stop strings (a tool call's end tag), or its token limit.
The sampled ids are kept exactly as sampled, with the log-prob of each under the distribution it
was sampled from: raw logits / temperature, the top-p mask, renormalised (with top_p = 1:
log_softmax(logits / temperature), what the actor stage computes), recorded by the single-turn
HF engine's forward hook ``rft_core.engines.hf.StepLogprobs``. Then
each environment steps on the decoded text of its turn (in ``env_workers`` threads), and an
observation is appended as the tokens of the chat template's suffix (``rft_core.agents.chat``):
the model's own tokens are never decoded and re-encoded, and the history is never re-rendered.

Reproducibility: each trajectory samples from its own ``torch.Generator`` seeded with
``rft_core.engines.sample_seed(seed, prompt index, sample index, n)`` (the vLLM engine's
per-sample seeds), drawing one uniform number per token it generates (inverse-CDF sampling inside
a logits processor; ``generate`` then picks that token greedily). A trajectory's tokens thus
depend on its seed, its own context and its environment only, not on which trajectories share
its batch or how many turns the others took (up to the floating-point effect of padding on the
logits). The same seed, prompts, model and deterministic environments give the same rollout.

Budgets: a turn may generate ``min(max_tokens_per_turn, max_total_tokens - tokens so far)``
tokens. ``finish_reason`` is ``stop`` (the environment said done, or gave no observation),
``length`` (a turn ran out of tokens, or the next observation would leave no room for a model
token: that observation is recorded but not appended), ``max_turns`` (the last allowed turn was
stepped and the environment was not done: its observation is recorded, not appended) or
``env_error`` (the environment failed and ``on_env_error`` is ``fallback``).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rft_core.agents.chat import ObservationRenderer
from rft_core.agents.env import EnvError, EnvFactory, coerce_step_result
from rft_core.config.agents import AgentConfig
from rft_core.engines import sample_seed
from rft_core.engines.hf import StepLogprobs
from schemas.experience import zero_pad_sequences


@dataclass
class Trajectory:
    """One multi-turn sample.

    Attributes:
        prompt_index, sample_index: which prompt row, and 0..n-1 within its group.
        prompt_token_ids: the prompt (the row's, plus the reset observation when there is one).
        response_token_ids: every token after the prompt: model turns and observations.
        logprobs: per response token, float, log p(token) under the distribution it was sampled
            from (logits / temperature, top-p) for model tokens, 0.0 for observation tokens.
        is_model: per response token, True on tokens the model sampled (the ``action_mask``).
        num_turns: model turns generated.
        tool_calls: one dict per environment step that had a call, an observation or an error:
            ``turn`` (1-based), ``name`` (str or None), ``arguments`` (JSON text, "" when no
            call was parsed), ``observation`` (str or None), ``error`` (str or None),
            ``seconds`` (wall time of the step).
        step_rewards: the environment's reward per step (None counted as 0.0).
        env_reward: the SUM of ``step_rewards``; ``fallback_reward`` on an env_error fallback.
        finish_reason: ``stop``, ``length``, ``max_turns`` or ``env_error`` (module docstring).
        final_text: decoded text of the last model turn (special tokens skipped): the answer.
        env_error: the environment's failure message (``env_error`` trajectories), else None.
        env_fallback: True when ``env_reward`` is the configured fallback, not the env's.
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    env_reward: float = 0.0
    finish_reason: str = ""
    final_text: str = ""
    env_error: str | None = None
    env_fallback: bool = False


# processors that greedy ``generate`` would still add from a model's generation_config.json (so
# the token drawn by ``_RowSampler`` and the log-prob ``StepLogprobs`` records are of one distribution)
_NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0}


class _RowSampler:
    """Logits processor that samples each row from its own generator (inverse CDF of
    softmax(scores / T), after top-p) and returns scores that make greedy decoding pick it."""

    def __init__(self, generators: list[torch.Generator], done: list[bool], *, temperature: float, top_p: float) -> None:
        self.generators, self.done, self.temperature = generators, done, temperature
        self.top_p = None
        if top_p < 1.0:
            from transformers import TopPLogitsWarper

            self.top_p = TopPLogitsWarper(top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        x = scores.float() / self.temperature
        if self.top_p is not None:
            x = self.top_p(input_ids, x)
        cdf = torch.softmax(x, dim=-1).double().cumsum(-1)
        u = torch.tensor([0.0 if d else float(torch.rand((), generator=g)) for g, d in zip(self.generators, self.done)],
                         dtype=torch.float64, device=cdf.device)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=cdf.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


class _TurnStop:
    """Stopping criterion: a row's turn ends at EOS, at one of its stop strings (checked on the
    decoded last few new tokens) or at its token limit; records where and why."""

    def __init__(self, tokenizer: Any, *, prompt_width: int, stops: list[tuple[str, ...]], eos_ids: set[int],
                 limits: list[int], done: list[bool]) -> None:
        self.tok, self.P, self.stops, self.eos, self.limits, self.done = tokenizer, prompt_width, stops, eos_ids, limits, done
        self.length = [0] * len(limits)
        self.reason = ["length"] * len(limits)

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        L = input_ids.shape[1]
        n = L - self.P
        last = input_ids[:, -1].tolist()
        for i, stops in enumerate(self.stops):
            if self.done[i]:
                continue
            why = "eos" if last[i] in self.eos else None
            if why is None and stops:
                window = max(len(s) for s in stops) + 1
                text = self.tok.decode(input_ids[i, max(self.P, L - window):].tolist(), skip_special_tokens=False)
                why = "stop" if any(s in text for s in stops) else None
            if why is None and n >= self.limits[i]:
                why = "length"
            if why is not None:
                self.done[i], self.length[i], self.reason[i] = True, n, why
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


@dataclass
class _State:
    traj: Trajectory
    env: Any
    generator: torch.Generator
    row: dict[str, Any]
    sample_id: str
    stops: tuple[str, ...] = ()
    last_eos: int | None = None  # the EOS token that ended the last turn, if one did


def env_row(row: dict[str, Any], sample_index: int) -> dict[str, Any]:
    """The prompt row an environment's ``reset`` gets: the row without token ids and media,
    ``metadata`` decoded from ``metadata_json``, plus ``sample_index``."""
    out = {k: v for k, v in row.items() if k not in ("prompt_token_ids", "images", "videos", "metadata_json")}
    if "metadata_json" in row:
        out["metadata"] = json.loads(row["metadata_json"] or "{}")
    out["sample_index"] = sample_index
    return out


class AgentRollout:
    """Runs multi-turn rollouts of ``model`` against the environments of ``cfg``.

    Args:
        model: an HF causal LM (``torch.nn.Module`` with ``generate``; its forward is hooked to
            record log-probs).
        tokenizer: its tokenizer, with a chat template.
        cfg: the ``AgentConfig``.
        logits_processors: extra ``transformers`` logits processors applied before sampling (e.g.
            to forbid tokens); the recorded log-probs stay those of the raw logits (temperature,
            top-p), so a processor that moves the distribution makes them off-policy.
    Raises:
        EnvConfigError: unknown environment or bad settings (before any generation).
        ChatTemplateError: the template cannot render observations as a suffix.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: AgentConfig, *, logits_processors: Sequence[Any] = ()) -> None:
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.factory = EnvFactory(cfg.environment, cfg.env_config)
        self.renderer = ObservationRenderer(tokenizer, role=cfg.observation_role)
        self.logits_processors = list(logits_processors)
        eos = tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._special = sorted({t for t in tokenizer.all_special_tokens if len(t) > 1}, key=len, reverse=True)

    @torch.no_grad()
    def run(self, rows: Sequence[dict[str, Any]], *, n_samples_per_prompt: int = 1, temperature: float = 1.0,
            top_p: float = 1.0, batch_size: int = 32, seed: int = 0, prompt_indices: Sequence[int] | None = None,
            progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
        """Sample ``n_samples_per_prompt`` trajectories per prompt row.

        Args:
            rows: prompt rows (``prompt_token_ids`` required; the rest goes to ``reset``, see
                ``env_row``); ``prompt_id`` names trajectories in errors (``{prompt_id}#{k}``).
            prompt_indices: the rows' indices in the whole rollout (for the seeds when a rollout
                is split over workers); default 0..len(rows)-1.
            progress: optional callable(finished trajectories, total) after each round.
        Returns:
            trajectories grouped by prompt in input order, then by sample index.
        Raises:
            ValueError: a row without ``prompt_token_ids`` or with images/videos (text-only for
                now), or a bad ``prompt_indices`` length.
            EnvError: an environment failed with ``on_env_error="raise"`` (the message names the
                environment, the trajectory, the turn and the failure, e.g. the server URL).
        """
        n, indices = n_samples_per_prompt, list(prompt_indices if prompt_indices is not None else range(len(rows)))
        if len(indices) != len(rows):
            raise ValueError(f"prompt_indices has {len(indices)} entries for {len(rows)} rows")
        states: list[_State] = []
        try:
            for p, row in enumerate(rows):
                if not row.get("prompt_token_ids"):
                    raise ValueError(f"prompt row {p} ({row.get('prompt_id', '?')}) has no prompt_token_ids")
                if row.get("images") or row.get("videos"):
                    raise ValueError(f"prompt row {p} ({row.get('prompt_id', '?')}) has images or videos; multi-turn "
                                     "rollouts support text-only prompts")
                for k in range(n):
                    g = torch.Generator().manual_seed(sample_seed(seed, indices[p], k, n, bits=62))
                    traj = Trajectory(p, k, list(row["prompt_token_ids"]))
                    states.append(_State(traj, None, g, env_row(row, k), f"{row.get('prompt_id', p)}#{k}"))
            with ThreadPoolExecutor(max_workers=self.cfg.env_workers, thread_name_prefix="rft-env") as pool:
                self._reset_all(states, pool)
                while active := [s for s in states if not s.traj.finish_reason]:
                    active.sort(key=lambda s: len(s.traj.prompt_token_ids) + len(s.traj.response_token_ids))
                    for start in range(0, len(active), batch_size):
                        self._generate(active[start:start + batch_size], temperature=temperature, top_p=top_p)
                    self._step_all([s for s in active if not s.traj.finish_reason], pool)
                    if progress is not None:
                        progress(sum(bool(s.traj.finish_reason) for s in states), len(states))
        finally:
            self._close_all(states)
        return [s.traj for s in states]

    def _close_all(self, states: list[_State]) -> None:
        """``close()`` every environment (in ``env_workers`` threads; errors ignored: closing is
        best effort and the trajectories stand)."""
        def close(s: _State) -> None:
            try:
                if s.env is not None and hasattr(s.env, "close"):
                    s.env.close()
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        with ThreadPoolExecutor(max_workers=self.cfg.env_workers, thread_name_prefix="rft-env-close") as pool:
            list(pool.map(close, states))

    def _fail(self, s: _State, what: str, exc: BaseException) -> None:
        """An environment failure: raise, or mark the trajectory env_error with the fallback."""
        msg = f"environment {self.factory.name!r} failed on {s.sample_id} ({what}): {type(exc).__name__}: {exc}"
        if self.cfg.on_env_error == "raise":
            raise EnvError(msg) from exc
        t = s.traj
        t.finish_reason, t.env_error, t.env_fallback, t.env_reward = "env_error", msg, True, self.cfg.fallback_reward

    def _reset_all(self, states: list[_State], pool: ThreadPoolExecutor) -> None:
        def reset(s: _State) -> tuple[Any, BaseException | None]:
            try:
                s.env = self.factory.new()
                s.stops = tuple(getattr(s.env, "stop_strings", ()) or ())
                obs = s.env.reset(s.row) if hasattr(s.env, "reset") else None
                if obs is not None and not isinstance(obs, str):
                    raise EnvError(f"reset returned {type(obs).__name__} {obs!r:.80}, not text or None")
                return obs, None
            except Exception as exc:  # noqa: BLE001 - reported per trajectory by _fail
                return None, exc

        for s, (obs, exc) in zip(states, list(pool.map(reset, states))):
            if exc is not None:
                self._fail(s, "reset", exc)
            elif obs is not None:
                s.traj.prompt_token_ids = self.renderer.prompt_with_observation(s.traj.prompt_token_ids, self._clip(obs))

    def _clip(self, text: str) -> str:
        """Observation text made safe and short: special-token strings in it (``<|im_end|>``) get a
        zero-width space after their first character, so an environment cannot forge turn
        boundaries; then it is cut to ``max_observation_tokens`` tokens."""
        for sp in self._special:
            if sp in text:
                text = text.replace(sp, f"{sp[0]}\u200b{sp[1:]}")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.cfg.max_observation_tokens:
            return text
        return self.tok.decode(ids[:self.cfg.max_observation_tokens]) + "\n... [observation truncated]"

    def _generate(self, chunk: list[_State], *, temperature: float, top_p: float) -> None:
        """One model turn for each trajectory of ``chunk``, appended to it (see module docstring)."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        cfg = self.cfg
        contexts = [torch.tensor(s.traj.prompt_token_ids + s.traj.response_token_ids, dtype=torch.long) for s in chunk]
        limits = []
        for s in chunk:
            left = cfg.max_total_tokens - len(s.traj.response_token_ids)
            limits.append(min(left, cfg.max_tokens_per_turn or left))
        device = next(self.model.parameters()).device
        input_ids = zero_pad_sequences(contexts, side="left", value=self.pad_token_id).to(device)
        attention_mask = zero_pad_sequences([torch.ones(len(c), dtype=torch.long) for c in contexts], side="left").to(device)
        P, done = input_ids.shape[1], [False] * len(chunk)
        sampler = _RowSampler([s.generator for s in chunk], done, temperature=temperature, top_p=top_p)
        stopper = _TurnStop(self.tok, prompt_width=P, stops=[s.stops for s in chunk], eos_ids=self.eos_ids,
                            limits=limits, done=done)
        recorder = StepLogprobs(temperature, top_p=top_p)
        handle = self.model.register_forward_hook(recorder, with_kwargs=True)
        try:
            gen = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max(limits),
                logits_processor=LogitsProcessorList([*self.logits_processors, sampler]),
                stopping_criteria=StoppingCriteriaList([stopper]), pad_token_id=self.pad_token_id,
                eos_token_id=sorted(self.eos_ids), use_cache=True, return_dict_in_generate=True,
                **_NEUTRAL)
        finally:
            handle.remove()
        new = gen.sequences[:, P:]
        lps = recorder.result(new)
        new = new.cpu()
        for i, s in enumerate(chunk):
            m = stopper.length[i] if done[i] else new.shape[1]
            tokens, t = new[i, :m].tolist(), s.traj
            t.response_token_ids += tokens
            t.logprobs += lps[i, :m].tolist()
            t.is_model += [True] * len(tokens)
            t.num_turns += 1
            t.final_text = self.tok.decode(tokens, skip_special_tokens=True)
            s.last_eos = tokens[-1] if tokens and stopper.reason[i] == "eos" else None
            if stopper.reason[i] == "length" or not done[i]:
                t.finish_reason = "length"

    def _step_all(self, states: list[_State], pool: ThreadPoolExecutor) -> None:
        def step(s: _State) -> tuple[Any, float, BaseException | None]:
            t0 = time.perf_counter()
            try:
                where = f"environment {self.factory.name!r} on {s.sample_id} turn {s.traj.num_turns}"
                return coerce_step_result(s.env.step(s.traj.final_text), where=where), time.perf_counter() - t0, None
            except Exception as exc:  # noqa: BLE001 - reported per trajectory by _fail
                return None, time.perf_counter() - t0, exc

        for s, (r, seconds, exc) in zip(states, list(pool.map(step, states))):
            t = s.traj
            if exc is not None:
                t.tool_calls.append({"turn": t.num_turns, "name": None, "arguments": "", "observation": None,
                                     "error": f"{type(exc).__name__}: {exc}", "seconds": seconds})
                self._fail(s, f"step of turn {t.num_turns}", exc)
                continue
            self._apply(s, r, seconds)

    def _apply(self, s: _State, r: Any, seconds: float) -> None:
        t, cfg = s.traj, self.cfg
        call, err = r.info.get("tool_call"), r.info.get("error")
        call = call if isinstance(call, dict) else {}
        if call or err or r.observation is not None:
            args = call.get("arguments")
            t.tool_calls.append({"turn": t.num_turns, "name": call.get("name"),
                                 "arguments": "" if args is None else json.dumps(args, sort_keys=True, default=str),
                                 "observation": r.observation, "error": None if err is None else str(err),
                                 "seconds": seconds})
        t.step_rewards.append(0.0 if r.reward is None else r.reward)
        t.env_reward = sum(t.step_rewards)
        if r.done or r.observation is None:
            t.finish_reason = "stop"
            return
        if t.num_turns >= cfg.max_turns:
            t.finish_reason = "max_turns"
            return
        last_text = self.tok.decode([s.last_eos], skip_special_tokens=False) if s.last_eos is not None else None
        obs_ids = self.renderer.after_turn_ids(self._clip(r.observation), last_token_text=last_text,
                                               name=str(call.get("name") or "tool"))
        if len(t.response_token_ids) + len(obs_ids) >= cfg.max_total_tokens:
            t.finish_reason = "length"
            return
        t.response_token_ids += obs_ids
        t.logprobs += [0.0] * len(obs_ids)
        t.is_model += [False] * len(obs_ids)


def run_agent_rollout(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], cfg: AgentConfig,
                      **kwargs: Any) -> list[Trajectory]:
    """``AgentRollout(model, tokenizer, cfg).run(rows, **kwargs)`` (see both)."""
    processors = kwargs.pop("logits_processors", ())
    return AgentRollout(model, tokenizer, cfg, logits_processors=processors).run(rows, **kwargs)
