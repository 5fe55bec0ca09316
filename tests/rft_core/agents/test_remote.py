"""The remote environment against the reference server on 127.0.0.1: the protocol, and a
server that is down, slow, failing or answering garbage."""
from __future__ import annotations

import threading
import time

import pytest

from rft_core.agents import EnvFactory, StepResult
from rft_core.agents.calculator import CalculatorEnv
from rft_core.agents.remote import RemoteEnvError
from rft_core.agents.server import EnvServer


class _Counting(CalculatorEnv):
    """The calculator, counting the steps it really ran (to see retries applied once)."""

    steps = 0
    lock = threading.Lock()

    def reset(self, prompt):
        super().reset(prompt)
        return f"question: {prompt['question']}"

    def step(self, text):
        with _Counting.lock:
            _Counting.steps += 1
        return super().step(text)


@pytest.fixture
def server():
    _Counting.steps = 0
    with EnvServer(_Counting) as s:
        yield s


def _remote(url: str, **kw):
    return EnvFactory("remote", {"url": url, "tool_format": "calc", "retries": 2, "backoff_s": 0.0, **kw}).new()


def test_protocol_round_trip(server):
    env = _remote(server.url)
    assert env.stop_strings == ("</calc>",)
    assert env.reset({"question": "12*34?", "images": b"\x00"}) == "question: 12*34?"
    r = env.step("<calc>12*34</calc>")
    assert r == StepResult("408", None, False, {"tool_call": {"name": "calculator", "arguments": {"expression": "12*34"}}})
    assert env.step("Answer: 408") == StepResult(None, None, True, {})
    assert env.session_id in server.sessions
    env.close()
    assert env.session_id not in server.sessions
    assert dict(server.requests) == {"/reset": 1, "/step": 2, "/close": 1}


def test_server_down_names_the_url(server):
    url = server.url
    server.stop()
    env = _remote(url, retries=1)
    with pytest.raises(RemoteEnvError, match=f"environment server {url}/reset: unreachable after 1 retries"):
        env.reset({"question": "q"})
    env.close()  # best effort, no error


def test_slow_reply_is_retried_and_applied_once(server):
    env = _remote(server.url, timeout_s=0.3)
    env.reset({"question": "q"})
    server.delays = [1.0]  # the first step's reply comes after the client's read timeout
    t0 = time.perf_counter()
    assert env.step("<calc>2+2</calc>").observation == "4"
    assert 0.3 <= time.perf_counter() - t0 < 1.0
    assert server.requests["/step"] == 2
    time.sleep(0.9)  # let the delayed first request finish on the server
    assert _Counting.steps == 1  # (session, turn) is the idempotency key: the repeat got the same reply


def test_slow_beyond_the_retries_names_the_url(server):
    env = _remote(server.url, timeout_s=0.2, retries=1)
    env.reset({"question": "q"})
    server.delays = [0.6, 0.6]
    with pytest.raises(RemoteEnvError, match=f"environment server {server.url}/step: "):
        env.step("<calc>1</calc>")
    assert server.requests["/step"] == 2


def test_garbage_and_errors_name_the_url(server):
    env = _remote(server.url)
    env.reset({"question": "q"})
    server.garbage = True
    with pytest.raises(RemoteEnvError, match=f"environment server {server.url}/step: reply is not JSON: 'this is not json {{'"):
        env.step("<calc>1</calc>")
    server.garbage, server.status = False, 503
    with pytest.raises(RemoteEnvError, match=f"{server.url}/step: .*(503|too many 503)"):
        env.step("<calc>1</calc>")
    assert server.requests["/step"] == 1 + 3  # garbage once, then 503 tried 1 + 2 retries
    server.status = 404
    with pytest.raises(RemoteEnvError, match="HTTP 404 \\(not retried\\)"):
        env.step("<calc>1</calc>")


def test_a_reply_that_breaks_the_protocol(server, monkeypatch):
    env = _remote(server.url)
    env.reset({"question": "q"})
    monkeypatch.setattr(server, "handle", lambda path, body: {"observation": 5, "done": False})
    with pytest.raises(RemoteEnvError, match="observation is int"):
        env.step("x")
    monkeypatch.setattr(server, "handle", lambda path, body: {"obs": "x"})
    with pytest.raises(RemoteEnvError, match="reply must be \\{observation, reward, done, info\\}"):
        env.step("x")
