"""Remote reward model over HTTP (the LightRFT / OpenRLHF ``remote_rm_url`` protocol).

Request: ``POST url`` with JSON ``{"queries": [...], "prompts": [...], "labels": [...],
"references": [...]}`` where ``queries[i]`` is prompt + response (the full text the policy
produced), ``prompts[i]`` the chat-templated prompt, ``labels[i]`` the sample's recipe label
(its data source) and ``references[i]`` the ground truth. When any sample of the request has
images, ``images[i]`` is the list of sample i's prompt images as base64 strings of the encoded
bytes (PNG/JPEG; [] for text-only samples); likewise ``videos[i]`` (base64 of each video's
container bytes, e.g. MP4) when any sample has videos. Reply: ``{"rewards": [float, ...]}``, one finite
number per query, in order.

HTTP goes through ``requests`` with urllib3's ``Retry``: connection errors, read timeouts and
HTTP 429/500/502/503/504 are retried ``retries`` times with exponential backoff
(``backoff_s * 2**(n-1)``, honouring ``Retry-After``); then a ``RewardError`` names the URL and
the last status or error.
"""
from __future__ import annotations

import base64
from typing import Sequence

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from rft_core.rewards.base import RewardError, RewardSample, SourceScore

RETRY_STATUSES = (429, 500, 502, 503, 504)


def make_session(retries: int, backoff_s: float) -> requests.Session:
    """A session whose POSTs are retried on connection errors, read timeouts and 429/5xx."""
    retry = Retry(total=retries, connect=retries, read=retries, status=retries, other=0, backoff_factor=backoff_s,
                  status_forcelist=RETRY_STATUSES, allowed_methods=frozenset({"POST"}), raise_on_status=False,
                  respect_retry_after_header=True)
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def post_rewards(url: str, payload: dict, *, expected: int, timeout_s: float, retries: int, backoff_s: float,
                 session: requests.Session | None = None) -> list[float]:
    """POST one batch and return its rewards.

    Returns:
        list of ``expected`` floats (the reply's ``rewards``, which may contain NaN: the engine
        checks finiteness and applies the source's policy).
    Raises:
        RewardError: the server stays unreachable, times out, answers a non-200 status after the
            retries, or answers something that is not ``{"rewards": [expected numbers]}``; the
            message names the URL and what went wrong.
    """
    own = session is None
    session = session or make_session(retries, backoff_s)
    try:
        resp = session.post(url, json=payload, timeout=(timeout_s, timeout_s))
    except requests.exceptions.RetryError as exc:
        raise RewardError(f"remote reward model {url}: still failing after {retries} retries ({exc})") from exc
    except requests.exceptions.Timeout as exc:
        raise RewardError(f"remote reward model {url}: no reply within {timeout_s:g} s after {retries} retries") from exc
    except requests.exceptions.ConnectionError as exc:
        raise RewardError(f"remote reward model {url}: unreachable after {retries} retries ({exc})") from exc
    finally:
        if own:
            session.close()
    if resp.status_code != 200:
        tried = f"after {retries} retries" if resp.status_code in RETRY_STATUSES else "not retried"
        raise RewardError(f"remote reward model {url}: HTTP {resp.status_code} ({tried}): {resp.text[:200]!r}")
    try:
        body = resp.json()
    except ValueError:
        raise RewardError(f"remote reward model {url}: reply is not JSON: {resp.text[:200]!r}") from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise RewardError(f"remote reward model {url}: reply has no 'rewards' list: {str(body)[:200]!r}")
    if len(rewards) != expected:
        raise RewardError(f"remote reward model {url}: sent {expected} queries, got {len(rewards)} rewards")
    out = []
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise RewardError(f"remote reward model {url}: rewards[{i}] is {r!r}, not a number")
        out.append(float(r))
    return out


class RemoteReward:
    """Source ``remote``: scores from a reward-model server (protocol in the module docstring),
    in requests of ``batch_size`` samples."""

    def __init__(self, cfg, name: str = "remote") -> None:
        self.cfg, self.name = cfg, name

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]:
        c = self.cfg
        out: list[SourceScore] = []
        with make_session(c.retries, c.backoff_s) as session:
            for start in range(0, len(samples), c.batch_size):
                batch = samples[start:start + c.batch_size]
                payload = {"queries": [s.prompt_text + s.response for s in batch],
                           "prompts": [s.prompt_text for s in batch],
                           "labels": [s.label for s in batch],
                           "references": [s.reference for s in batch]}
                for kind in ("images", "videos"):
                    if any(getattr(s, kind) for s in batch):
                        payload[kind] = [[base64.b64encode(b).decode("ascii") for b in getattr(s, kind)] for s in batch]
                rewards = post_rewards(c.url, payload, expected=len(batch), timeout_s=c.timeout_s, retries=c.retries,
                                       backoff_s=c.backoff_s, session=session)
                out.extend(SourceScore(r) for r in rewards)  # NaN/inf are checked by the engine
        return out
