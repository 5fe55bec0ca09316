"""LLM judge (source ``type: llm_judge``): a rubric per sample sent to an OpenAI-compatible
chat-completions endpoint, the reply parsed into a score, every verdict stored and cached.

Request. The template (``LLMJudgeSource.effective_template``; without one the default rubric
``rft_core.config.rewards.DEFAULT_JUDGE_TEMPLATE``) is filled with ``str.format`` from the
sample's ``question``, ``response`` and ``reference`` and sent as the user message, after the
``system`` message when one is set, with the official ``openai`` client:
``OpenAI(base_url, api_key, max_retries, timeout).chat.completions.create(model, messages,
temperature, max_tokens, seed[, top_p])``. The key is the environment variable ``api_key_env``
(``OPENAI_API_KEY``). Retries with backoff are the client's own (``max_retries``): connection
errors, timeouts, HTTP 408, 409, 429 and 5xx, waiting about 0.5 s * 2**n (at most 8 s, with
jitter; a ``Retry-After`` header is honoured). At most ``max_concurrency`` requests are in flight.
``seed`` makes a sampling judge repeatable where the endpoint supports it (vLLM, SGLang,
llama.cpp's server, OpenAI); the default temperature is 0 (greedy).

Parse rule (``parse_score``), on the reply with ``<think>...</think>`` blocks removed:

- ``parse: number``: the last match of ``pattern`` (default ``DEFAULT_SCORE_PATTERN``: the
  number after the last ``Score:``) is a number x that must lie in ``score_range`` [lo, hi];
  the score is (x - lo) / (hi - lo) with ``normalize`` (the default), else x;
- ``parse: label``: the last occurrence (any case, as a whole word) of a key of ``labels``, or
  the last match of ``pattern`` when one is given (its text must then be such a key), scores
  that label's value.

A reply that yields no score is that sample's error (``VerdictParseError``): with ``on_error:
raise`` (the default) the stage stops with a message naming the source, the sample, the
endpoint and the reply's end; with ``on_error: fallback`` the sample scores ``fallback`` and the
reason is recorded (``rft_core.rewards.engine``). A request the endpoint refuses for this
sample (HTTP 400, 422: e.g. a prompt longer than the judge's context) is such an error too.

Verdicts are data. Each sample's verdict (``schemas.columns.JUDGE_VERDICT``: source, judge model,
endpoint, template hash, sample hash, system and user message sent, raw reply, the model that
answered, finish reason, parsed score) goes into the rewards shard's ``judge_verdicts`` column.
It is also kept under the run's storage, keyed by ``verdict_key``: (judge model, template hash,
sample hash, and the request settings that shape a reply: temperature, top_p, max_tokens, seed),
one JSON object per verdict, ``{cache_root}/_judge_verdicts/<key[:2]>/<key>.json``, written
atomically (``schemas.atomic_put``) as soon as its reply arrives. So a stage killed half-way, an
outage, a Prefect retry (from the UI too) or a rerun of the same run root asks the judge only for
samples it has no verdict for, and a sample judged once is never sent again, in any iteration
of the run. What is kept is the raw reply: the score is parsed from it again, so another parse
rule needs no new request. Failed requests are not kept.

Failures of the endpoint itself (unreachable, timing out or answering 429/5xx after the
retries, refusing the key: 401/403, not knowing the model or path: 404) raise
``SourceUnavailableError`` naming the source, the model and the endpoint, once the requests in
flight have finished (their verdicts are kept); it is never replaced by a fallback. A key
variable that is not set is raised before any request (and by ``check_judge_keys`` before a
run starts).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from rft_core.config.rewards import DEFAULT_SCORE_PATTERN, LLMJudgeSource, RewardConfig
from rft_core.rewards.base import RewardSample, SourceScore, SourceUnavailableError
from schemas import atomic_put, filesystem, is_object_store, storage_errors

log = logging.getLogger("rft_core.rewards.judge")

VERDICTS_FOLDER = "_judge_verdicts"
RETRIED_STATUSES = (408, 409, 429)  # and every 5xx: the openai client's own retry rule (_should_retry)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)


class VerdictParseError(ValueError):
    """A judge's reply that yields no score under the source's parse rule; the message says why."""


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def template_hash(cfg: LLMJudgeSource) -> str:
    """sha256 (hex, first 16) of the system message and the effective template: what a verdict
    was asked with, besides the sample."""
    return _sha({"system": cfg.system, "template": cfg.effective_template})[:16]


def sample_hash(sample: RewardSample) -> str:
    """sha256 (hex, first 32) of what a template can show of a sample: its question, response
    and reference (``JUDGE_PLACEHOLDERS``), whatever the template uses of them."""
    return _sha([sample.question, sample.response, sample.reference])[:32]


def request_settings(cfg: LLMJudgeSource) -> dict[str, Any]:
    """The request's settings that shape the reply, besides the model and the messages."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "seed": cfg.seed}


def verdict_key(cfg: LLMJudgeSource, template: str, sample: str) -> str:
    """The cache key of a verdict (sha256 hex): the judge model, the template hash ``template``,
    the sample hash ``sample`` and ``request_settings``. The endpoint is not part of it: the same
    model behind another URL is the same judge."""
    return _sha({"model": cfg.model, "template_hash": template, "sample_hash": sample,
                 "request": request_settings(cfg)})


def render_prompt(cfg: LLMJudgeSource, sample: RewardSample) -> str:
    """The user message for ``sample``: the effective template filled with its question,
    response and reference (placeholders checked when the config loaded)."""
    return cfg.effective_template.format(question=sample.question, response=sample.response, reference=sample.reference)


def parse_score(reply: str, cfg: LLMJudgeSource) -> float:
    """The score of a judge's reply under the source's parse rule (module docstring).

    Args:
        reply: the reply's text; ``<think>...</think>`` blocks (an unclosed one: to the end) are
            removed first.
    Returns:
        float: ``parse: number``: (x - lo) / (hi - lo) in [0, 1] with ``normalize``, else x in
        ``score_range``; ``parse: label``: the label's value from ``labels``.
    Raises:
        VerdictParseError: no match, a number outside ``score_range``, or (label with a
            ``pattern``) matched text that is no label; the message says which.
    """
    text = _THINK.sub("", reply)
    if cfg.parse == "number":
        found = re.findall(cfg.pattern or DEFAULT_SCORE_PATTERN, text)
        if not found:
            raise VerdictParseError(f"no score in the reply (pattern {cfg.pattern or DEFAULT_SCORE_PATTERN!r})")
        try:
            x = float(found[-1])
        except ValueError:
            raise VerdictParseError(f"the reply's score {found[-1]!r} is not a number") from None
        lo, hi = cfg.score_range
        if not lo <= x <= hi:
            raise VerdictParseError(f"the reply's score {x:g} is outside score_range [{lo:g}, {hi:g}]")
        return (x - lo) / (hi - lo) if cfg.normalize else x
    by_lower = {k.strip().lower(): v for k, v in cfg.labels.items()}
    if cfg.pattern is not None:
        found = re.findall(cfg.pattern, text)
        if not found:
            raise VerdictParseError(f"no label in the reply (pattern {cfg.pattern!r})")
        label = found[-1].strip().lower()
        if label not in by_lower:
            raise VerdictParseError(f"the reply's label {found[-1]!r} is none of {sorted(cfg.labels)}")
        return float(by_lower[label])
    # longest first, so that a label containing another (INCORRECT, CORRECT) is matched whole
    alternatives = "|".join(re.escape(k.strip()) for k in sorted(cfg.labels, key=lambda k: -len(k.strip())))
    found = re.findall(rf"(?<!\w)({alternatives})(?!\w)", text, flags=re.IGNORECASE)
    if not found:
        raise VerdictParseError(f"none of the labels {sorted(cfg.labels)} in the reply")
    return float(by_lower[found[-1].lower()])


class VerdictCache:
    """The verdicts of a run, one JSON object per ``verdict_key`` under
    ``{root}/_judge_verdicts/`` on the run's storage (any fsspec URI).

    Args:
        root: the run root (or, for a stage outside the run layout, the folder it sits in).
    """

    def __init__(self, root: str) -> None:
        self.uri = f"{root.rstrip('/')}/{VERDICTS_FOLDER}"
        self.fs, self.path = filesystem(self.uri)

    def _file(self, key: str) -> str:
        return f"{self.path}/{key[:2]}/{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored verdict of ``key``, or None (none stored, or an unreadable one, which is
        logged and asked again).

        Raises:
            StorageError: the storage refused the read (names the folder and the cause).
        """
        try:
            with storage_errors(self.uri, action="reading"):
                raw = self.fs.cat_file(self._file(key))
        except FileNotFoundError:
            return None
        try:
            entry = json.loads(raw)
            if entry.get("key") != key or not isinstance(entry.get("reply"), str):
                raise ValueError("not the verdict of this key")
        except (ValueError, AttributeError) as exc:
            log.warning("%s/%s/%s.json: unreadable stored verdict (%s); asking the judge again", self.uri, key[:2], key, exc)
            return None
        return entry

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """{key: verdict} of the ``keys`` that have one stored (read 16 at a time)."""
        if not keys:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(keys))) as pool:
            found = dict(zip(keys, pool.map(self.get, keys)))
        return {k: v for k, v in found.items() if v is not None}

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store a verdict atomically (a reader never sees part of one).

        Raises:
            StorageError: the storage refused the write (names the folder and the cause).
        """
        path = self._file(key)
        with storage_errors(self.uri):
            if not is_object_store(self.fs):
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            atomic_put(self.fs, path, json.dumps(entry, ensure_ascii=False, indent=1).encode())


class _SampleRequestError(Exception):
    """The endpoint refused the request of one sample (HTTP 400/422): that sample's error."""


def api_key(cfg: LLMJudgeSource, name: str) -> str:
    """The API key of a judge source: the value of ``api_key_env``, or "EMPTY" when it is None
    (a local server that checks no key; vLLM's documented placeholder).

    Raises:
        SourceUnavailableError: the variable is not set (or empty); names the source, the
            variable and the endpoint.
    """
    if cfg.api_key_env is None:
        return "EMPTY"
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise SourceUnavailableError(
            f"reward source {name!r} (llm_judge {cfg.model!r} at {cfg.base_url}): the environment variable "
            f"{cfg.api_key_env} holds no API key; set it, name another variable in reward.sources.{name}.api_key_env, "
            f"or set reward.sources.{name}.api_key_env: null for a server that checks no key")
    return key


def check_judge_keys(reward: RewardConfig) -> str:
    """Check, before a run starts, that every llm_judge source a recipe uses has its API key in
    the environment (no request is made: a run that resumes from stored verdicts needs no server).

    Returns:
        one line naming the judges checked ("" when the config has none).
    Raises:
        SourceUnavailableError: a key variable is not set (``api_key``).
    """
    resolved = reward.resolved
    used = {item.source for items in resolved.recipes.values() for item in items}
    judges = [(n, s) for n, s in resolved.sources.items() if n in used and isinstance(s, LLMJudgeSource)]
    for name, src in judges:
        api_key(src, name)
    return f"llm judges: {', '.join(f'{n} ({s.model} at {s.base_url})' for n, s in judges)}" if judges else ""


class LLMJudgeReward:
    """Source ``llm_judge`` (module docstring).

    Args:
        cfg: its ``LLMJudgeSource``.
        name: the source's name in ``reward.sources``.
        cache_root: where verdicts are kept (``VerdictCache``); None: nothing kept, every
            sample asked.
    Attributes:
        last_stats: of the last ``score``: ``judge_requests`` (verdicts asked of the endpoint),
            ``judge_stored`` (verdicts read from storage instead); duplicates of a batch count once.
    """

    uses_cache_root = True

    def __init__(self, cfg: LLMJudgeSource, name: str = "llm_judge", *, cache_root: str | None = None) -> None:
        self.cfg, self.name = cfg, name
        self.cache = VerdictCache(cache_root) if cache_root else None
        self.template_hash = template_hash(cfg)
        self.last_stats: dict[str, float] = {}

    @property
    def where(self) -> str:
        """The source, its model and endpoint, as messages name them."""
        return f"reward source {self.name!r} (llm_judge {self.cfg.model!r} at {self.cfg.base_url})"

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]:
        """One score per sample, in order, each with its verdict as ``record``.

        Raises:
            SourceUnavailableError: the key is missing, or the endpoint failed (module docstring).
            StorageError: a verdict could not be stored.
        """
        hashes = [sample_hash(s) for s in samples]
        keys = [verdict_key(self.cfg, self.template_hash, h) for h in hashes]
        asks = {k: (s, h) for k, s, h in zip(keys, samples, hashes)}  # one request per distinct key
        found = self.cache.get_many(list(asks)) if self.cache else {}
        todo = [k for k in asks if k not in found]
        errors: dict[str, str] = {}
        if todo:
            asked, errors = self._ask_all([(k, *asks[k]) for k in todo])
            found.update(asked)
        self.last_stats = {"judge_requests": float(len(todo)), "judge_stored": float(len(asks) - len(todo))}
        return [self._verdict(s, k, h, found.get(k), errors.get(k)) for s, k, h in zip(samples, keys, hashes)]

    def _verdict(self, sample: RewardSample, key: str, shash: str, entry: dict[str, Any] | None,
                 error: str | None) -> SourceScore:
        record = {"source": self.name, "judge_model": self.cfg.model, "endpoint": self.cfg.base_url,
                  "template_hash": self.template_hash, "sample_hash": shash, "system": self.cfg.system,
                  "prompt": render_prompt(self.cfg, sample), "reply": "", "served_model": None, "finish_reason": None,
                  "score": None, "error": error}
        if entry is None:
            return SourceScore(float("nan"), error=f"the request to the judge at {self.cfg.base_url} failed: {error}",
                               record=record)
        record.update({k: entry.get(k) for k in ("endpoint", "system", "prompt", "reply", "served_model", "finish_reason")})
        try:
            score = parse_score(entry["reply"], self.cfg)
        except VerdictParseError as exc:
            return SourceScore(float("nan"), error=f"{exc}; reply of {self.cfg.model!r} at {record['endpoint']} "
                               f"(finish_reason {record['finish_reason']}) ends {entry['reply'][-200:]!r}", record=record)
        record["score"] = score
        return SourceScore(score, record=record)

    def _ask_all(self, todo: list[tuple[str, RewardSample, str]]) -> tuple[dict[str, dict], dict[str, str]]:
        """Ask the judge for each (key, sample, sample hash), ``max_concurrency`` at a time; each
        verdict is stored as soon as it arrives. Returns ({key: verdict}, {key: request error}).

        Raises:
            SourceUnavailableError: after the requests in flight finished (none is started after
                the first failure), naming how many verdicts were stored.
        """
        client = self._client()
        stop = threading.Event()
        asked: dict[str, dict] = {}
        errors: dict[str, str] = {}
        failures: list[BaseException] = []

        def one(item: tuple[str, RewardSample, str]) -> None:
            key, sample, shash = item
            if stop.is_set():
                return
            try:
                entry = self._request(client, key, sample, shash)
                if self.cache is not None:
                    self.cache.put(key, entry)
                asked[key] = entry
            except _SampleRequestError as exc:
                errors[key] = str(exc)
            except BaseException as exc:  # noqa: BLE001 - the first failure stops the others; raised below
                stop.set()
                failures.append(exc)

        try:
            with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(todo)),
                                    thread_name_prefix=f"judge-{self.name}") as pool:
                list(pool.map(one, todo))
        finally:
            client.close()
        if failures:
            exc = failures[0]
            if isinstance(exc, SourceUnavailableError):
                kept = (f"{len(asked)} of the {len(todo)} verdicts asked for were stored under {self.cache.uri}: a rerun "
                        f"asks only for the other {len(todo) - len(asked)}" if self.cache
                        else f"{len(asked)} of the {len(todo)} verdicts asked for came (none kept: no verdict folder)")
                raise SourceUnavailableError(f"{exc}; {kept}") from exc
            raise exc
        return asked, errors

    def _client(self):
        import openai  # lazy: ~1 s to import; only a stage that has to ask a judge pays it

        return openai.OpenAI(base_url=self.cfg.base_url, api_key=api_key(self.cfg, self.name),
                             max_retries=self.cfg.max_retries, timeout=self.cfg.timeout_s)

    def _request(self, client, key: str, sample: RewardSample, shash: str) -> dict[str, Any]:
        """One chat completion; the verdict to store.

        Raises:
            _SampleRequestError: HTTP 400/422, or a reply without text (this sample's error).
            SourceUnavailableError: any other failure, after the client's retries.
        """
        import openai  # lazy: as in _client

        c = self.cfg
        prompt = render_prompt(c, sample)
        messages = ([{"role": "system", "content": c.system}] if c.system is not None else []) + \
            [{"role": "user", "content": prompt}]
        extra = {k: v for k, v in (("seed", c.seed), ("top_p", c.top_p)) if v is not None}
        retries = f"after {c.max_retries} retries"
        try:
            resp = client.chat.completions.create(model=c.model, messages=messages, temperature=c.temperature,
                                                  max_tokens=c.max_tokens, **extra)
        except openai.APITimeoutError as exc:
            raise SourceUnavailableError(f"{self.where}: no reply within {c.timeout_s:g} s, {retries}") from exc
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise SourceUnavailableError(f"{self.where}: unreachable {retries} ({type(cause).__name__}: {cause})") from exc
        except openai.APIStatusError as exc:
            status = exc.status_code
            body = exc.body if isinstance(exc.body, dict) else {}  # the client passes the reply's "error" object
            said = str(body.get("message") or exc.message)[:300]
            if status in (400, 422):
                raise _SampleRequestError(f"HTTP {status}: {said}") from exc
            why = {401: "the API key was refused", 403: "the API key may not use this model",
                   404: "no such model or path (check base_url, which ends in /v1 for most servers, and model)"}
            tried = retries if status in RETRIED_STATUSES or status >= 500 else "not retried"
            raise SourceUnavailableError(f"{self.where}: HTTP {status} ({tried}){': ' + why[status] if status in why else ''}: "
                                         f"{said}") from exc
        choice = resp.choices[0] if resp.choices else None
        content = choice.message.content if choice is not None else None
        if not isinstance(content, str):
            raise _SampleRequestError(f"a reply without text (finish_reason {getattr(choice, 'finish_reason', None)})")
        return {"key": key, "judge_model": c.model, "endpoint": c.base_url, "template_hash": self.template_hash,
                "sample_hash": shash, "request": request_settings(c), "system": c.system, "prompt": prompt,
                "reply": content, "served_model": getattr(resp, "model", None), "finish_reason": choice.finish_reason,
                "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat()}
