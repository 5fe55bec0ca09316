"""A reference environment server for the ``remote`` environment's protocol
(``rft_core.agents.remote``), on the standard library's ``http.server``.

It serves any environment this package can build (one instance per session), answers a
repeated ``(session_id, turn)`` step with its first reply (the protocol's idempotency rule), and
can be made to misbehave for tests: ``delays`` (seconds to sleep before each of the next
replies), ``garbage`` (reply 200 with a body that is not JSON), ``status`` (reply with this HTTP
status); ``requests`` counts the requests per path.

Run one from the command line (Ctrl-C stops it)::

    python -m rft_core.agents.server --env calculator --port 8765
    # rollout.agent: {environment: remote, env_config: {url: "http://127.0.0.1:8765", tool_format: calc}}
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rft_core.agents.env import EnvFactory, coerce_step_result


class EnvServer:
    """Serves ``factory()`` environments on ``host:port`` (0: a free port) in a daemon thread.

    Attributes:
        url: ``http://host:port`` once started.
        delays: list of seconds; each request pops the first one and sleeps that long first.
        garbage: reply 200 with ``"this is not json {"``.
        status: reply with this HTTP status (and a JSON error body) instead of serving.
        requests: Counter of requests per path (``/reset``, ``/step``, ``/close``).
    """

    def __init__(self, factory: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.factory = factory
        self.sessions: dict[str, Any] = {}
        self.replies: dict[tuple[str, int], dict[str, Any]] = {}
        self.delays: list[float] = []
        self.garbage = False
        self.status: int | None = None
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> EnvServer:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rft-env-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (later requests are refused)."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> EnvServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The reply to one request (see the protocol). Raises: KeyError/ValueError on a bad
        request (the handler answers HTTP 400)."""
        sid = str(body["session_id"])
        if path == "/reset":
            env = self.factory()
            with self._lock:
                self.sessions[sid] = env
            return {"observation": env.reset(body.get("prompt") or {})}
        if path == "/step":
            key = (sid, int(body["turn"]))
            with self._lock:
                if key in self.replies:
                    return self.replies[key]
                env = self.sessions[sid]
            r = coerce_step_result(env.step(str(body["text"])), where=f"server session {sid}")
            reply = {"observation": r.observation, "reward": r.reward, "done": r.done,
                     "info": json.loads(json.dumps(r.info, default=str))}
            with self._lock:
                self.replies[key] = reply
            return reply
        if path == "/close":
            with self._lock:
                env = self.sessions.pop(sid, None)
            if env is not None and hasattr(env, "close"):
                env.close()
            return {}
        raise KeyError(path)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                with server._lock:
                    server.requests[self.path] += 1
                    delay = server.delays.pop(0) if server.delays else 0.0
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if delay:
                    time.sleep(delay)
                if server.status is not None:
                    return self._send(server.status, json.dumps({"error": f"status {server.status}"}).encode())
                if server.garbage:
                    return self._send(200, b"this is not json {")
                try:
                    reply = server.handle(self.path, json.loads(raw or b"{}"))
                except (KeyError, ValueError, TypeError) as exc:
                    return self._send(400, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
                self._send(200, json.dumps(reply).encode())

        return Handler


def main(argv: list[str] | None = None) -> None:
    """``python -m rft_core.agents.server --env NAME [--config JSON] [--host H] [--port P]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", required=True, help="environment name or file.py:Class")
    ap.add_argument("--config", default="{}", help="the environment's settings as JSON")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args(argv)
    factory = EnvFactory(args.env, json.loads(args.config))
    server = EnvServer(factory.new, host=args.host, port=args.port)
    print(f"serving environment {args.env!r} at {server.url}", flush=True)
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()


if __name__ == "__main__":
    main()
