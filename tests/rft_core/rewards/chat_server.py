"""A small OpenAI-compatible chat-completions server for the judge tests (stdlib ``http.server``),
started and stopped by a test; the client under test stays the official ``openai`` one.

It speaks ``POST {base}/chat/completions`` (JSON body with ``model`` and ``messages``; reply
``{"id", "object": "chat.completion", "created", "model", "choices": [{"index", "message":
{"role": "assistant", "content"}, "finish_reason"}], "usage"}``, as in OpenAI's API reference and
vLLM's server) and ``GET {base}/models``. What it answers and how it fails, a test sets.
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def send_json(handler: BaseHTTPRequestHandler, code: int, data: bytes) -> None:
    """Answer ``handler``'s request with status ``code`` and the JSON bytes ``data`` (a client
    that gave up meanwhile is ignored)."""
    try:
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
        pass


def response_of(messages: list[dict]) -> str:
    """The text between ``[Response]`` and the next blank line of the last user message (where the
    default rubric puts the policy's response); the whole message when it has no such block."""
    text = messages[-1]["content"]
    m = re.search(r"\[Response\]\n(.*?)\n\n", text, re.DOTALL)
    return m.group(1) if m else text


def length_score(messages: list[dict]) -> str:
    """The default reply: a line of reasoning, then ``Score: N`` with N = len(response) % 11, so
    a test can compute every score by hand."""
    return f"The response has {len(response_of(messages))} characters.\nScore: {len(response_of(messages)) % 11}"


class ChatServer:
    """A chat-completions server on 127.0.0.1 (a free port), in a daemon thread.

    Attributes a test sets: ``reply`` (messages -> text), ``key`` (the bearer key required; None:
    any), ``fail_first`` (the first N requests get HTTP ``fail_status``), ``drop_after`` (after N
    answered requests every further one is dropped: the connection closes without a reply, as a
    server that dies mid-run), ``status_for`` (messages -> an HTTP status to answer instead, or
    None), ``delay_s`` (each reply waits this long). It records every request body
    (``requests``), and the most requests it had in flight at once (``max_active``).
    """

    def __init__(self, reply: Callable[[list[dict]], str] = length_score, *, key: str | None = "test-key") -> None:
        self.reply, self.key = reply, key
        self.fail_first, self.fail_status, self.drop_after, self.delay_s = 0, 503, None, 0.0
        self.status_for: Callable[[list[dict]], int | None] = lambda messages: None
        self.requests: list[dict] = []
        self.answered = 0
        self.active = self.max_active = 0
        self._lock = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, port: int = 0) -> "ChatServer":
        """Listen on ``port`` (0: a free one; a restarted server passes its old port)."""
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    return self._send(200, {"object": "list", "data": [{"id": "judge", "object": "model"}]})
                return self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with state._lock:
                    state.requests.append(body)
                    n = len(state.requests)
                    dropped = state.drop_after is not None and state.answered >= state.drop_after
                    if not dropped:
                        state.active += 1
                        state.max_active = max(state.max_active, state.active)
                try:
                    if dropped:  # a dead server: no status line, the connection just closes
                        self.close_connection = True
                        return
                    if not self.path.rstrip("/").endswith("/chat/completions"):
                        return self._send(404, {"error": {"message": f"no route {self.path}"}})
                    if state.key is not None and self.headers.get("Authorization") != f"Bearer {state.key}":
                        return self._send(401, {"error": {"message": "Incorrect API key provided"}})
                    if n <= state.fail_first:
                        return self._send(state.fail_status, {"error": {"message": "overloaded"}})
                    status = state.status_for(body["messages"])
                    if status is not None:
                        return self._send(status, {"error": {"message": "maximum context length exceeded"}})
                    if state.delay_s:
                        time.sleep(state.delay_s)
                    text = state.reply(body["messages"])
                    with state._lock:
                        state.answered += 1
                    return self._send(200, {
                        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": f"{body['model']}-served",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                finally:
                    if not dropped:
                        with state._lock:
                            state.active -= 1

            def _send(self, code: int, obj: dict) -> None:
                send_json(self, code, json.dumps(obj).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening (a request then finds the port closed: connection refused)."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
