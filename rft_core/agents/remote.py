"""The ``remote`` environment: an environment server over HTTP, JSON in and out.

Protocol (all ``POST``, ``Content-Type: application/json``; a reference server is
``rft_core.agents.server``):

- ``{url}/reset`` ``{"session_id": str, "prompt": {prompt row}}`` -> ``{"observation": str | null}``
- ``{url}/step`` ``{"session_id": str, "turn": int, "text": str}`` ->
  ``{"observation": str | null, "reward": float | null, "done": bool, "info": {...}}``
  (``turn`` counts from 1; ``info`` may hold ``tool_call`` and ``error`` as in ``StepResult``)
- ``{url}/close`` ``{"session_id": str}`` -> anything (best effort, one try, errors ignored)

HTTP goes through the session of the remote reward source (``rft_core.rewards.remote.make_session``:
``requests`` + urllib3 ``Retry``): connection errors, read timeouts and HTTP 429/500/502/503/504
are retried ``retries`` times with exponential backoff (``backoff_s * 2**(n-1)``, honouring
``Retry-After``). A step whose reply timed out may therefore reach the server twice: servers must
treat ``(session_id, turn)`` as an idempotency key and answer a repeated step with the reply they
gave the first time (the reference server does). After the retries, or on a reply that is not
the JSON above, ``RemoteEnvError`` names the URL and what went wrong; the rollout loop then fails
the stage (``on_env_error: raise``, so it is retried) or marks the trajectory ``env_error`` with
the fallback reward.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import requests
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rft_core.config._base import _check_name
from rft_core.agents.env import EnvError, Environment, StepResult, coerce_step_result
from rft_core.agents.tools import TOOL_FORMATS
from rft_core.rewards.remote import RETRY_STATUSES, make_session


class RemoteEnvError(EnvError):
    """The environment server stayed unreachable, timed out, answered an HTTP error or a reply
    that breaks the protocol; the message names the URL."""


class RemoteEnvConfig(BaseModel):
    """Settings of the ``remote`` environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(description="base URL of the server: POSTs go to {url}/reset, {url}/step, {url}/close")
    tool_format: str | None = Field("hermes", description="the TOOL_FORMATS name whose stop strings end a turn "
                                    "(the server parses the calls); None: turns end at EOS only")
    timeout_s: float = Field(30.0, gt=0, description="connect and read timeout per request (s)")
    retries: int = Field(3, ge=0, description="retries on connection errors, timeouts and HTTP 429/5xx")
    backoff_s: float = Field(0.5, ge=0, description="backoff factor: waits backoff_s * 2**(n-1) before retry n")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    _format = field_validator("tool_format")(lambda cls, v: v if v is None else _check_name(TOOL_FORMATS, v))


def post_json(session: requests.Session, url: str, payload: dict[str, Any], *, timeout_s: float,
              retries: int) -> dict[str, Any]:
    """POST ``payload`` and return the reply object.

    Raises:
        RemoteEnvError: unreachable, timed out or HTTP 429/5xx after ``retries`` retries, another
            non-200 status, or a reply that is not a JSON object; the message names ``url``.
    """
    try:
        resp = session.post(url, json=payload, timeout=(timeout_s, timeout_s))
    except requests.exceptions.RetryError as exc:
        raise RemoteEnvError(f"environment server {url}: still failing after {retries} retries ({exc})") from exc
    except requests.exceptions.Timeout as exc:
        raise RemoteEnvError(f"environment server {url}: no reply within {timeout_s:g} s after {retries} retries") from exc
    except requests.exceptions.ConnectionError as exc:
        raise RemoteEnvError(f"environment server {url}: unreachable after {retries} retries ({exc})") from exc
    if resp.status_code != 200:
        tried = f"after {retries} retries" if resp.status_code in RETRY_STATUSES else "not retried"
        raise RemoteEnvError(f"environment server {url}: HTTP {resp.status_code} ({tried}): {resp.text[:200]!r}")
    try:
        body = resp.json()
    except ValueError:
        raise RemoteEnvError(f"environment server {url}: reply is not JSON: {resp.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise RemoteEnvError(f"environment server {url}: reply is not a JSON object: {resp.text[:200]!r}")
    return body


class RemoteEnv(Environment):
    """One session on an environment server (protocol in the module docstring)."""

    Config = RemoteEnvConfig

    def __init__(self, config: RemoteEnvConfig) -> None:
        self.config = config
        self.stop_strings = TOOL_FORMATS[config.tool_format].stop_strings if config.tool_format else ()
        self.session_id = uuid.uuid4().hex
        self.turn = 0
        self._http = make_session(config.retries, config.backoff_s)

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        return post_json(self._http, f"{c.url}/{path}", payload, timeout_s=c.timeout_s, retries=c.retries)

    def reset(self, prompt: dict[str, Any]) -> str | None:
        """Open the session. Raises: RemoteEnvError (naming the URL)."""
        row = json.loads(json.dumps(prompt, default=str))  # JSON-able (bytes and the like as text)
        body = self._post("reset", {"session_id": self.session_id, "prompt": row})
        obs = body.get("observation")
        if obs is not None and not isinstance(obs, str):
            raise RemoteEnvError(f"environment server {self.config.url}/reset: observation is {obs!r:.80}, not text or null")
        return obs

    def step(self, text: str) -> StepResult:
        """Send the turn. Raises: RemoteEnvError: transport failure or a reply that is not
        ``{observation, reward, done, info}`` with valid types (naming the URL)."""
        self.turn += 1
        url = f"{self.config.url}/step"
        body = self._post("step", {"session_id": self.session_id, "turn": self.turn, "text": text})
        unknown = set(body) - {"observation", "reward", "done", "info"}
        if "done" not in body or unknown:
            raise RemoteEnvError(f"environment server {url}: reply must be {{observation, reward, done, info}}, got "
                                 f"{json.dumps(body)[:200]}")
        try:
            return coerce_step_result({**body, "info": body.get("info") or {}}, where=f"environment server {url}")
        except EnvError as exc:
            raise RemoteEnvError(str(exc)) from None

    def close(self) -> None:
        """Tell the server the session is over (one try, at most 2 s, errors ignored)."""
        try:
            requests.post(f"{self.config.url}/close", json={"session_id": self.session_id},
                          timeout=min(self.config.timeout_s, 2.0))
        except requests.RequestException:
            pass
        finally:
            self._http.close()
