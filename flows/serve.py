"""A local deployment stack for ``rft serve``: a Prefect server, the process work pool, the `gpu`
tag concurrency limit, the deployments of prefect.yaml, and a worker.

Each step is the Prefect CLI command docs/deploy.md gives (``prefect server start``,
``prefect work-pool create local --type process``, ``prefect concurrency-limit create gpu 1``,
``prefect deploy --all``, ``prefect worker start --pool local``), run as a subprocess of this
Python with ``PREFECT_API_URL`` pointing at the server, so ``serve`` does nothing a user could
not do by hand. The server and the worker run in their own process groups; ``LocalStack.stop``
ends exactly those (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
POOL = "local"  # the work pool prefect.yaml names


class ServeError(RuntimeError):
    """A step of the local stack failed; the message names the step and shows its output."""


def prefect_cmd(*args: str) -> list[str]:
    """``python -m prefect <args>`` with this interpreter (the project's venv)."""
    return [sys.executable, "-m", "prefect", *args]


def api_healthy(api_url: str, timeout: float = 2.0) -> bool:
    """True when a Prefect server answers ``GET {api_url}/health``."""
    try:
        return httpx.get(f"{api_url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def _stop(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM the process group of ``proc`` (started with start_new_session), SIGKILL after grace_s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


@dataclass
class LocalStack:
    """What ``start_stack`` started: ``server`` is None when a server was already running."""

    api_url: str
    ui_url: str
    env: dict[str, str]
    log_dir: Path
    server: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    deployments: list[str] = field(default_factory=list)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the worker, then the server (only those this stack started)."""
        _stop(self.worker, grace_s)
        _stop(self.server, grace_s)


def _pool_exists(api_url: str, name: str) -> bool:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import ObjectNotFound

    with SyncPrefectClient(api=api_url) as client:
        try:
            client.read_work_pool(name)
            return True
        except ObjectNotFound:
            return False


def deployment_names(api_url: str) -> list[str]:
    """``flow-name/deployment-name`` of every deployment on the server, sorted."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api=api_url) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())


def _run_step(cmd: list[str], env: dict[str, str], what: str, echo: Callable[[str], None], timeout_s: float = 300) -> str:
    echo(f"$ {' '.join(cmd[2:]) if cmd[:3] == prefect_cmd()[:3] else ' '.join(cmd)}")
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ServeError(f"{what}: no answer in {timeout_s:.0f} s") from exc
    if out.returncode != 0:
        text = (out.stdout + out.stderr).strip().splitlines()
        raise ServeError(f"{what} failed (exit {out.returncode}):\n" + "\n".join(text[-40:]))
    return out.stdout


def _start_server(stack: LocalStack, host: str, port: int, timeout_s: float, echo: Callable[[str], None]) -> None:
    """``prefect server start`` into ``stack.server``, waiting until its API answers.

    Raises:
        ServeError: the server exited (the port is in use?) or did not answer in ``timeout_s``.
    """
    log = stack.log_dir / "server.log"
    echo(f"$ prefect server start --host {host} --port {port}   (output: {log})")
    with open(log, "wb") as fh:
        stack.server = subprocess.Popen(prefect_cmd("server", "start", "--host", host, "--port", str(port)),
                                        cwd=ROOT, env=stack.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not api_healthy(stack.api_url):
        if stack.server.poll() is not None:
            raise ServeError(f"prefect server start exited with {stack.server.returncode} (port {port} in use?):\n" + _tail(log))
        if time.monotonic() > deadline:
            raise ServeError(f"the Prefect server did not answer at {stack.api_url} within {timeout_s:.0f} s:\n" + _tail(log))
        time.sleep(0.5)
    echo(f"server up: {stack.ui_url} (pid {stack.server.pid})")


def start_stack(host: str = "127.0.0.1", port: int = 4200, *, gpu_limit: int = 1, deploy: bool = True,
                worker: bool = True, poll_seconds: float = 5.0, log_dir: Path | None = None,
                server_timeout_s: float = 180.0, echo: Callable[[str], None] = print) -> LocalStack:
    """Start (or reuse) a server on ``host:port`` and bring up the pool, limit, deployments, worker.

    Args:
        host, port: where the server listens; a Prefect server already answering there is reused
            (and not stopped by ``LocalStack.stop``).
        gpu_limit: slots of the `gpu` tag concurrency limit (0: leave the limits alone).
        deploy: run ``prefect deploy --all`` from the repository root.
        worker: start ``prefect worker start --pool local``; its output goes to this terminal.
        poll_seconds: how often the worker asks for scheduled runs (PREFECT_WORKER_QUERY_SECONDS).
        log_dir: where the server's output goes (default: ``$PREFECT_HOME/serve`` or ``~/.prefect/serve``).
    Raises:
        ServeError: the port is taken by something that is not a Prefect server, the server
            did not come up in ``server_timeout_s``, or a step failed (its output is in the message).
    """
    api_url = f"http://{host}:{port}/api"
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_UI_API_URL": api_url, "PWD": str(ROOT),
           "PREFECT_WORKER_QUERY_SECONDS": str(poll_seconds)}
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    log_dir = Path(log_dir or home / "serve")
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(api_url=api_url, ui_url=f"http://{host}:{port}", env=env, log_dir=log_dir)
    try:
        if api_healthy(api_url):
            echo(f"using the Prefect server already running at {stack.ui_url}")
        else:
            _start_server(stack, host, port, server_timeout_s, echo)
        if not _pool_exists(api_url, POOL):
            _run_step(prefect_cmd("work-pool", "create", POOL, "--type", "process"), env, "creating the work pool", echo)
        if gpu_limit > 0:
            _run_step(prefect_cmd("concurrency-limit", "create", "gpu", str(gpu_limit)), env,
                      "creating the gpu concurrency limit", echo)
        if deploy:
            _run_step(prefect_cmd("deploy", "--all"), env, "prefect deploy --all", echo)
            stack.deployments = deployment_names(api_url)
            echo("deployments: " + ", ".join(stack.deployments))
        if worker:
            echo(f"$ prefect worker start --pool {POOL}")
            stack.worker = subprocess.Popen(prefect_cmd("worker", "start", "--pool", POOL), cwd=ROOT, env=env,
                                            start_new_session=True)
            echo(f"worker started (pid {stack.worker.pid})")
    except BaseException:
        stack.stop()
        raise
    return stack
