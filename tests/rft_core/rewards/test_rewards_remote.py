"""Remote reward model against a real HTTP server on 127.0.0.1: the protocol, retries with
backoff, and a server that is slow, down, failing or answering garbage."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rft_core.config import RemoteSource, load_config
from rft_core.rewards.base import RewardError, RewardSample
from rft_core.rewards.engine import RewardEngine
from rft_core.rewards.remote import RemoteReward
from tests.rft_core.rewards.chat_server import send_json


class _Server:
    """A reward server whose behaviour a test sets: ``mode`` and ``fail_first``."""

    def __init__(self) -> None:
        self.mode, self.fail_first, self.requests = "ok", 0, []
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                state.requests.append(body)
                if len(state.requests) <= state.fail_first:
                    return self._send(503, b'{"error": "warming up"}')
                n = len(body["queries"])
                # the reward of a query: its response length (query minus prompt), /10
                rewards = [(len(q) - len(p)) / 10 for q, p in zip(body["queries"], body["prompts"])]
                if state.mode == "ok":
                    return self._send(200, json.dumps({"rewards": rewards}).encode())
                if state.mode == "slow":
                    time.sleep(1.0)
                    return self._send(200, json.dumps({"rewards": rewards}).encode())
                if state.mode == "garbage":
                    return self._send(200, b"<html>oops</html>")
                if state.mode == "no_key":
                    return self._send(200, b'{"scores": [1]}')
                if state.mode == "short":
                    return self._send(200, json.dumps({"rewards": rewards[: n - 1]}).encode())
                if state.mode == "string":
                    return self._send(200, json.dumps({"rewards": ["high"] * n}).encode())
                if state.mode == "nan":
                    return self._send(200, json.dumps({"rewards": [float("nan")] * n}).encode())
                if state.mode == "500":
                    return self._send(500, b"internal error")
                if state.mode == "404":
                    return self._send(404, b"not found")

            def _send(self, code, data):
                send_json(self, code, data)  # a client that gave up (slow mode) is ignored

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.httpd.shutdown()


@pytest.fixture(autouse=True)
def _reset(server):
    server.mode, server.fail_first, server.requests = "ok", 0, []


def _samples(n):
    return [RewardSample(sample_id=f"s{i}", prompt_id=f"p{i // 2}", label="chat", question=f"q{i}",
                        prompt_text=f"<prompt {i}>", response="x" * (i + 1), reference=f"ref{i}") for i in range(n)]


def _remote(url, **kw):
    return RemoteReward(RemoteSource(url=url, **{"timeout_s": 5, "retries": 2, "backoff_s": 0.01, **kw}))


def test_protocol_and_batching(server):
    out = _remote(server.url, batch_size=2).score(_samples(5))
    assert [s.score for s in out] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [len(r["queries"]) for r in server.requests] == [2, 2, 1]
    first = server.requests[0]
    assert first == {"queries": ["<prompt 0>x", "<prompt 1>xx"], "prompts": ["<prompt 0>", "<prompt 1>"],
                     "labels": ["chat", "chat"], "references": ["ref0", "ref1"]}


def test_retries_with_backoff_then_succeeds(server):
    server.fail_first = 2  # two 503s, then a good reply: within retries=2
    out = _remote(server.url).score(_samples(2))
    assert [s.score for s in out] == pytest.approx([0.1, 0.2]) and len(server.requests) == 3


def test_stays_failing_names_url_and_status(server):
    server.mode = "500"
    with pytest.raises(RewardError, match=rf"remote reward model {server.url}: HTTP 500 \(after 2 retries\): 'internal error'"):
        _remote(server.url).score(_samples(1))
    assert len(server.requests) == 3  # 1 + 2 retries
    server.requests.clear()
    server.mode = "404"  # not retried: a client error
    with pytest.raises(RewardError, match=rf"{server.url}: HTTP 404 \(not retried\): 'not found'"):
        _remote(server.url).score(_samples(1))
    assert len(server.requests) == 1


def test_slow_server_times_out(server):
    server.mode = "slow"
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=rf"{server.url}.*(no reply within 0.2 s|still failing|unreachable)"):
        _remote(server.url, timeout_s=0.2, retries=1).score(_samples(1))
    assert time.perf_counter() - t0 < 5 and len(server.requests) == 2  # first try + 1 retry


def test_server_down():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/reward"
    with pytest.raises(RewardError, match=rf"remote reward model {url}: (unreachable|still failing) after 2 retries"):
        _remote(url).score(_samples(1))


@pytest.mark.parametrize("mode, why", [("garbage", "reply is not JSON: '<html>oops</html>'"),
                                       ("no_key", "reply has no 'rewards' list"),
                                       ("short", "sent 3 queries, got 2 rewards"),
                                       ("string", r"rewards\[0\] is 'high', not a number")])
def test_garbage_replies_are_clear_errors(server, mode, why):
    server.mode = mode
    with pytest.raises(RewardError, match=why):
        _remote(server.url).score(_samples(3))


def test_nan_rewards_through_the_engine(server):
    server.mode = "nan"
    sources = {"rm": {"type": "remote", "url": server.url, "retries": 0}}
    recipes = {"chat": [{"source": "rm"}]}
    cfg = load_config(None, {"reward.sources": sources, "reward.recipes": recipes}).reward
    with pytest.raises(RewardError, match="reward source 'rm' on sample s0: returned nan, not a finite number"):
        RewardEngine(cfg).score(_samples(2))
    sources["rm"].update(on_error="fallback", fallback=0.0)
    cfg = load_config(None, {"reward.sources": sources, "reward.recipes": recipes}).reward
    batch = RewardEngine(cfg).score(_samples(2))
    assert [r.reward for r in batch.results] == [0.0, 0.0] and batch.fallbacks == 2
    assert all(r.metrics["rm.fallback"] == 1.0 for r in batch.results)


def test_server_down_with_fallback_is_counted():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sources = {"rm": {"type": "remote", "url": f"http://127.0.0.1:{port}/", "retries": 0, "on_error": "fallback",
                      "fallback": -0.5}, "f": {"type": "format"}}
    cfg = load_config(None, {"reward.sources": sources,
                             "reward.recipes": {"chat": [{"source": "rm"}, {"source": "f", "weight": 1.0}]}}).reward
    batch = RewardEngine(cfg).score(_samples(3))
    assert [r.reward for r in batch.results] == [-0.5] * 3 and batch.fallbacks == 3
    assert "unreachable" in batch.results[0].reasons["rm"]


def test_images_are_sent_as_base64(server):
    import base64
    from dataclasses import replace

    png = b"\x89PNG\r\n\x1a\n-fake-image-bytes"
    samples = _samples(3)
    samples = [replace(samples[0], images=[png, png[::-1]]), samples[1], replace(samples[2], images=[png])]
    _remote(server.url).score(samples)
    sent = server.requests[0]["images"]
    assert [[base64.b64decode(x) for x in row] for row in sent] == [[png, png[::-1]], [], [png]]
    server.requests.clear()
    _remote(server.url).score(_samples(2))  # text-only requests keep the plain protocol
    assert "images" not in server.requests[0]


def test_videos_are_sent_as_base64(server):
    import base64
    from dataclasses import replace

    import numpy as np

    from rft_core.data.video import encode_video

    mp4 = encode_video(np.arange(2 * 8 * 8 * 3, dtype=np.uint8).reshape(2, 8, 8, 3), 2.0)
    png = b"\x89PNG\r\n\x1a\n-fake-image-bytes"
    samples = _samples(3)
    samples = [replace(samples[0], videos=[mp4]), replace(samples[1], images=[png], videos=[mp4, mp4[:40]]), samples[2]]
    _remote(server.url).score(samples)
    sent = server.requests[0]
    assert [[base64.b64decode(x) for x in row] for row in sent["videos"]] == [[mp4], [mp4, mp4[:40]], []]
    assert [[base64.b64decode(x) for x in row] for row in sent["images"]] == [[], [png], []]
    server.requests.clear()
    _remote(server.url).score([replace(s, images=[png]) for s in _samples(2)])  # no video: no videos key
    assert "videos" not in server.requests[0] and "images" in server.requests[0]
