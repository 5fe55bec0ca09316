"""Code-execution reward: run a response against the problem's unit tests in a sandbox.

Each sample runs in its own subprocess (``_sandbox_harness.py``), in a fresh temporary working
directory outside the run folder, with:

- a wall-time limit (the whole process group is killed past ``timeout_s``) and a CPU-time
  rlimit just above it;
- an address-space rlimit (``memory_mb``), a 16 MiB file-size limit, 64 open files, no core
  dumps (set with util-linux ``prlimit``);
- no network: a fresh network namespace (``unshare --net``, or a user namespace when not root)
  where the kernel allows it, and in every case an audit hook that refuses sockets;
- a clean environment (no PYTHONPATH, no tokens; HOME and TMPDIR are the working directory),
  ``python -I`` (no user site, no cwd on sys.path), stdin closed;
- an audit hook that refuses reading files outside the interpreter's prefixes and the working
  directory, writing outside the working directory, subprocesses, signals and ctypes.

A response that hangs, crashes, eats memory or tries any of the above gets reward 0 and a
reason; the stage itself never hangs or breaks. This is defence in depth against an RL policy
that stumbles into harmful code, not a jail for a determined attacker: run the reward stage in
a container (a stage program or a Kubernetes work pool) for untrusted models.

HumanEval (Chen et al. 2021, arXiv:2107.03374) is the default data: ``program = prompt +
completion + test + check(entry_point)``, pass = exit 0.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rft_core.rewards.base import RewardError, SourceScore

HARNESS = Path(__file__).with_name("_sandbox_harness.py")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_EXIT_REASONS = {2: "syntax error", 3: "refused by the sandbox", 4: "called exit", 5: "out of memory"}


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program.

    Attributes:
        passed: exit status 0 within the limits.
        reason: ``passed``, ``timeout after 5 s``, ``AssertionError``, ``MemoryError: ...``,
            ``sandbox: socket.__new__ is not allowed``, ``killed by SIGXCPU``, ...
        returncode: the process's exit status (negative: killed by that signal); None on timeout.
        seconds: wall time.
        isolation: ``namespace+audit`` or ``audit`` (the network namespace could not be made).
        stdout: what the program printed (decoded as UTF-8, errors replaced).
        stderr: what it wrote to stderr, without the harness's last status line.
    """

    passed: bool
    reason: str
    returncode: int | None
    seconds: float
    isolation: str
    stdout: str = ""
    stderr: str = ""


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give a new network namespace here, or () when none works."""
    if not shutil.which("unshare"):
        return ()
    candidates = [("unshare", "--net")] if os.geteuid() == 0 else []
    candidates.append(("unshare", "--user", "--map-root-user", "--net"))
    for cmd in candidates:
        try:
            if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                return cmd
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


def _readable_prefixes() -> list[str]:
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})


def _limits(timeout_s: float, memory_mb: int) -> list[str]:
    mb = 1024 * 1024
    return [f"--as={memory_mb * mb}", f"--cpu={int(timeout_s) + 1}", f"--fsize={16 * mb}", "--nofile=64", "--core=0"]


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


def run_sandboxed(program: str, *, timeout_s: float = 5.0, memory_mb: int = 512, network: str = "namespace",
                  python: str | None = None) -> ExecResult:
    """Run ``program`` (Python source) in the sandbox described in the module docstring.

    Args:
        program: the whole program; it passes when it exits normally.
        timeout_s: wall-time limit in seconds.
        memory_mb: address-space limit in MiB.
        network: ``namespace`` (network namespace where the kernel allows, plus the audit hook)
            or ``audit`` (the audit hook only).
        python: interpreter (default: this one).
    Raises:
        RuntimeError: ``prlimit`` is missing (util-linux), so limits cannot be set.
    """
    if not shutil.which("prlimit"):
        raise RuntimeError("code_exec reward needs util-linux `prlimit` on PATH to set rlimits")
    netns = _netns_prefix() if network == "namespace" else ()
    isolation = "namespace+audit" if netns else "audit"
    work = Path(tempfile.mkdtemp(prefix="rft-sandbox-"))
    try:
        (work / "solution.py").write_text(program, encoding="utf-8")
        cmd = [*netns, "prlimit", *_limits(timeout_s, memory_mb), "--", python or sys.executable, "-I", "-B",
               str(HARNESS), "solution.py", json.dumps(_readable_prefixes())]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole group, also on success (stray children)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        seconds = time.perf_counter() - t0
        stdout = _read(work / "stdout.txt")
        lines = _read(work / "stderr.txt").rstrip("\n").split("\n")
        status = lines[-1] if rc is not None and rc >= 0 else ""  # the harness's last line says why
        out = {"seconds": seconds, "isolation": isolation, "stdout": stdout,
               "stderr": "\n".join(lines[:-1] if status else lines).rstrip("\n")}
        if rc is None:
            return ExecResult(False, f"timeout after {timeout_s:g} s", None, **out)
        if rc == 0:
            return ExecResult(True, "passed", 0, **out)
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            why = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit", "SIGKILL": "killed",
                   "SIGSEGV": "crashed (segfault)"}.get(name, "killed")
            return ExecResult(False, f"{why} ({name})", rc, **out)
        last = [ln for ln in lines if ln.strip()]
        detail = last[-1][:300] if last else ""
        reason = detail or _EXIT_REASONS.get(rc, f"exit status {rc}")
        if rc == 5 or "MemoryError" in detail:
            reason = f"out of memory (limit {memory_mb} MiB)"
        return ExecResult(False, reason, rc, **out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def extract_code(response: str, entry_point: str | None = None) -> str:
    """The code in a response: the fenced block that defines ``entry_point`` (else the first
    fenced block), or the whole response when it has no fence (a bare completion)."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    if entry_point:
        for b in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M):
                return b
    return blocks[0]


def humaneval_program(prompt: str, response: str, test: str, entry_point: str) -> str:
    """The program that checks a HumanEval response.

    A response that defines ``entry_point`` itself replaces the prompt's stub (the prompt stays
    in front for its imports and helpers); otherwise it is taken as the body that continues the
    prompt. Then the problem's ``test`` and ``check(entry_point)``.
    """
    code = extract_code(response, entry_point)
    defines = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None
    body = f"{prompt}\n{code}" if defines else f"{prompt}{code}"
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


class CodeExecReward:
    """Source ``code_exec``: 1.0 when the response passes the problem's unit tests, else 0.0.

    A sample needs ``metadata['test']`` and ``metadata['entry_point']`` (HumanEval rows have
    them; ``metadata['prompt']`` is the code prompt, else ``question`` is used). Samples run in
    parallel threads, each one a sandboxed subprocess. ``reason`` says why a sample failed;
    ``extras['seconds']`` is its wall time.

    Raises (from ``score``):
        RewardError: a sample without ``test``/``entry_point`` metadata.
    """

    def __init__(self, cfg, name: str = "code_exec") -> None:
        self.cfg, self.name = cfg, name

    def _one(self, s):
        prompt = s.metadata.get("prompt", s.question)
        program = humaneval_program(prompt, s.response, s.metadata["test"], s.metadata["entry_point"])
        r = run_sandboxed(program, timeout_s=self.cfg.timeout_s, memory_mb=self.cfg.memory_mb, network=self.cfg.network)
        return SourceScore(float(r.passed), r.passed, None, None if r.passed else r.reason,
                           {"seconds": round(r.seconds, 4), "netns": float(r.isolation == "namespace+audit")})

    def score(self, samples):
        for s in samples:
            missing = [k for k in ("test", "entry_point") if k not in s.metadata]
            if missing:
                raise RewardError(f"reward source {self.name!r}: sample {s.sample_id} has no {missing} in its "
                                  "metadata; code_exec needs HumanEval-style rows (test, entry_point)")
        workers = self.cfg.max_workers or os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self._one, samples))


def has_code_block(sample) -> float:
    """A ``python`` reward function: 1.0 when the response has a fenced code block that defines
    the problem's entry point (a format reward for code tasks), else 0.0."""
    entry = sample.metadata.get("entry_point")
    blocks = _FENCE.findall(sample.response)
    return float(any(re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", b, re.M) for b in blocks) if entry else bool(blocks))
