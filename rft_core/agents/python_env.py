"""The ``python`` environment: runs the model's code in the code-execution sandbox of the
``code_exec`` reward (``rft_core.rewards.code``: its harness ``_sandbox_harness.py``, rlimits
via ``prlimit``, a fresh temporary directory, a network namespace where the kernel allows it,
the audit hook, a clean environment, ``python -I``) and answers with its stdout/stderr,
truncated.

Each call is a separate program: variables do not survive from one call to the next.

``run_sandboxed`` of the reward returns only a pass/fail reason, not the program's output, so
``run_program`` below starts the same harness with the same limits through that module's
helpers and keeps the output files before the directory is removed (see the report of issue 20
for the one-field change to ``ExecResult`` that would let this call ``run_sandboxed``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rft_core.config._base import _check_name
from rft_core.agents.tools import TOOL_FORMATS, ToolEnvironment, ToolFailure
from rft_core.rewards import code as sandbox


@dataclass(frozen=True)
class ProgramOutput:
    """What one sandboxed program did.

    Attributes:
        ok: exit status 0 within the limits.
        reason: ``ok``, ``timeout after 5 s``, ``ZeroDivisionError: division by zero``,
            ``sandbox: socket.__new__ is not allowed``, ``out of memory (limit 512 MiB)``, ...
        stdout, stderr: the program's output (stderr without the harness's status line).
        seconds: wall time.
    """

    ok: bool
    reason: str
    stdout: str
    stderr: str
    seconds: float


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read(16 << 20)  # the sandbox's file-size limit
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def run_program(program: str, *, timeout_s: float = 5.0, memory_mb: int = 512, network: str = "namespace"
                ) -> ProgramOutput:
    """Run ``program`` (Python source) in the sandbox of ``rft_core.rewards.code.run_sandboxed``
    (its harness, rlimits, network namespace, clean environment, and the kill of the whole
    process group) and return its output.

    Raises:
        RuntimeError: util-linux ``prlimit`` is missing (no rlimits can be set).
    """
    res = sandbox.run_sandboxed(program, timeout_s=timeout_s, memory_mb=memory_mb, network=network)
    reason = "ok" if res.passed else res.reason
    return ProgramOutput(res.passed, reason, res.stdout, res.stderr, res.seconds)


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, with a note of how many were left out."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n... [{len(text) - max_chars} more characters truncated]"


class PythonEnvConfig(BaseModel):
    """Settings of the ``python`` environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_format: str = Field("python", description="python (<python>code</python>) or hermes "
                             '(<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>)')
    timeout_s: float = Field(5.0, gt=0, description="wall-time limit per call (s)")
    memory_mb: int = Field(512, ge=64, description="address-space limit per call (MiB)")
    network: Literal["namespace", "audit"] = "namespace"
    max_output_chars: int = Field(1000, gt=0, description="observation text beyond this is truncated")

    _format = field_validator("tool_format")(lambda cls, v: _check_name(TOOL_FORMATS, v))


class PythonEnv(ToolEnvironment):
    """Tool ``python(code)``: the observation is the program's stdout (and stderr when there is
    any); a program that raises, is refused by the sandbox, runs out of memory or time gives an
    ``error: <reason>`` observation (after the output it printed before) and ``info["error"]``.
    """

    Config = PythonEnvConfig

    def __init__(self, config: PythonEnvConfig | None = None) -> None:
        self.config = config or PythonEnvConfig()
        super().__init__(self.config.tool_format, {"python": self.run})

    def run(self, code: str) -> str:
        """Tool ``python(code)``. Raises: ToolFailure: the program failed (the observation is its
        output, then ``error: <reason>``)."""
        c = self.config
        if not isinstance(code, str):
            raise TypeError(f"code must be text, got {type(code).__name__}")
        out = run_program(code, timeout_s=c.timeout_s, memory_mb=c.memory_mb, network=c.network)
        text = out.stdout + (f"\nstderr:\n{out.stderr}" if out.stderr.strip() else "")
        if not out.ok:
            shown = truncate(text.rstrip("\n"), c.max_output_chars)
            raise ToolFailure(out.reason, f"{shown}\nerror: {out.reason}" if shown.strip() else f"error: {out.reason}")
        return truncate(text, c.max_output_chars) if text.strip() else "(no output)"

