"""Run a stage program in the calling process or as ``python -m rft_core.stages <stage> ...``.

Both ways call the same function (``PROGRAMS[program]``) with the same stage input model
(``rft_core.stages.contracts``), so they commit the same shard under the same config hash; a
subprocess is how a stage runs with another interpreter (an environment with vLLM, which cannot
share one with Prefect) or under torchrun (a multi-rank DeepSpeed update). The input crosses the
process boundary as the model's JSON and is validated on the other side by the same model, so a
ShardRef or a config arrives as exactly the object that was sent.

Never imports prefect: the task hands in its run logger's ``info`` as the ``log`` callback.
"""
from __future__ import annotations

import collections
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic import TypeAdapter

from rft_core.config import RunnerConfig
from rft_core.stages.contracts import PROGRAMS, STAGE_INPUTS, StageInput
from rft_core.stages.inprocess import run_in_process  # importing it registers the programs
from rft_core.stages.memo import keeping_models
from rft_core.stages.recovery import keep_rebuilt
from schemas import ShardNotCommittedError, ShardRef, read_manifest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# programs that support several ranks (torchrun with nproc_per_node > 1 or several nodes)
DISTRIBUTED_STAGES = frozenset({"ppo_update", "critic_update"})


class StageProcessError(RuntimeError):
    """A stage subprocess failed. ``returncode`` is its exit status (negative: killed by that
    signal), ``tail`` its last output lines."""

    def __init__(self, stage: str, returncode: int, cmd: list[str], tail: list[str]) -> None:
        self.stage, self.returncode, self.cmd, self.tail = stage, returncode, cmd, tail
        how = f"exit code {returncode}"
        if returncode < 0:
            try:
                how += f" (killed by {signal.Signals(-returncode).name})"
            except ValueError:
                pass
        super().__init__(f"stage {stage!r} subprocess failed with {how}\ncommand: {shlex.join(cmd)}\n"
                         f"last {len(tail)} output lines:\n" + "\n".join(tail))


# program name -> its input model
INPUTS: dict[str, type[StageInput]] = {cls.program: cls for cls in STAGE_INPUTS if cls.program in PROGRAMS}


def input_model(program: str) -> type[StageInput]:
    """The input model of ``program``.

    Raises:
        KeyError: unknown program; the message lists the valid names.
    """
    if program not in INPUTS:
        raise KeyError(f"unknown stage program {program!r}; valid names: {', '.join(INPUTS)}")
    return INPUTS[program]


def _return_type(program: str) -> Any:
    return typing.get_type_hints(PROGRAMS[program])["return"]


def _allows_shardref(hint: Any) -> bool:
    return hint is ShardRef or any(_allows_shardref(a) for a in typing.get_args(hint))


def _is_committed_stage(value: str) -> bool:
    try:
        read_manifest(value)
    except (ShardNotCommittedError, OSError, ValueError):
        return False
    return True


def input_from_args(program: str, raw: Mapping[str, Any]) -> StageInput:
    """The input model of ``program`` from JSON-decoded field values (the command line's).

    A string given for a field that takes a ShardRef and naming a committed stage folder (one
    with a manifest) becomes that stage's ShardRef; for a policy (``str | ShardRef``) any other
    string stays a model path.

    Raises:
        KeyError: an unknown program.
        pydantic.ValidationError: an unknown field, a missing one, or a value that does not fit
            its type (named).
    """
    cls = input_model(program)
    values = dict(raw)
    for name, value in raw.items():
        field = cls.model_fields.get(name)
        if field is not None and isinstance(value, str) and _allows_shardref(field.annotation) and _is_committed_stage(value):
            values[name] = ShardRef.from_manifest(value)
    return cls.model_validate(values)


def encode_result(program: str, result: Any) -> str:
    """JSON of a program's return value."""
    return TypeAdapter(_return_type(program)).dump_json(result).decode()


def decode_result(program: str, text: str) -> Any:
    """Inverse of ``encode_result``."""
    return TypeAdapter(_return_type(program)).validate_json(text)


def stage_command(inp: StageInput, runner: RunnerConfig, *, input_file: str, result_file: str) -> list[str]:
    """The command line of a stage subprocess: ``[python] -m rft_core.stages <program> --input
    <file> --result <file>`` (``input_file`` holds the input model's JSON), wrapped in
    ``python -m torch.distributed.run`` for the torchrun launcher (``--standalone`` on one node
    unless ``torchrun_args`` give a rendezvous)."""
    python = runner.python or sys.executable
    prog = ["-m", "rft_core.stages", inp.program, "--input", input_file, "--result", result_file]
    if runner.launcher == "plain":
        return [python, *prog]
    rdzv = any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in runner.torchrun_args)
    return [python, "-m", "torch.distributed.run", f"--nproc-per-node={runner.nproc_per_node}",
            *([] if rdzv else ["--standalone"]), *runner.torchrun_args, *prog]


def stream_process(cmd: list[str], *, env: Mapping[str, str], log: Callable[[str], None] | None,
                   tail_lines: int) -> tuple[int, list[str]]:
    """Run ``cmd`` (stderr merged into stdout), pass each output line to ``log`` as it arrives.

    The child gets its own session; if the caller is interrupted (an exception in ``log``,
    KeyboardInterrupt, a cancelled task) the whole child process group is killed.

    Returns:
        (exit status, the last ``tail_lines`` lines).
    """
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dict(env), start_new_session=True, errors="replace")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if log is not None:
                log(line)
        return proc.wait(), list(tail)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


def subprocess_env(runner: RunnerConfig) -> dict[str, str]:
    """The child's environment: ours, unbuffered output, the project root first on PYTHONPATH
    (so the stage programs import in another interpreter's environment too), ``runner.env``."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.update(runner.env)
    return env


def launch(inp: StageInput, runner: RunnerConfig, *, log: Callable[[str], None] | None = None) -> Any:
    """Run the program of ``inp`` as a subprocess and return what it returned.

    Raises:
        StageProcessError: non-zero exit (exit code and the last output lines in the message),
            or an exit 0 without a result.
        ValueError: several ranks for a program that does not support them.
    """
    program = inp.program
    ranks = runner.nproc_per_node if runner.launcher == "torchrun" else 1
    if (ranks > 1 or runner.torchrun_args) and program not in DISTRIBUTED_STAGES:
        raise ValueError(f"stage {program!r} runs on one rank only; torchrun with several ranks supports "
                         f"{sorted(DISTRIBUTED_STAGES)}")
    with tempfile.TemporaryDirectory(prefix=f"rft-{program}-") as tmp:
        input_file, result_file = str(Path(tmp) / "input.json"), str(Path(tmp) / "result.json")
        Path(input_file).write_text(inp.model_dump_json())
        cmd = stage_command(inp, runner, input_file=input_file, result_file=result_file)
        rc, tail = stream_process(cmd, env=subprocess_env(runner), log=log, tail_lines=runner.tail_lines)
        if rc != 0:
            raise StageProcessError(program, rc, cmd, tail)
        if Path(result_file).exists():
            return decode_result(program, Path(result_file).read_text())
        # multi-node: global rank 0 (which writes the result) may run on another node; the stage
        # committed its shard to shared storage, so read the ref from its manifest
        if _is_committed_stage(inp.out):
            return ShardRef.from_manifest(inp.out)
        raise StageProcessError(program, rc, cmd, tail + ["(exit code 0 but no result was written)"])


def run_stage(inp: StageInput, runner: RunnerConfig | None = None, *, log: Callable[[str], None] | None = None,
              resident: Callable[[StageInput, Any], Any] | None = None) -> Any:
    """Run the program of ``inp`` in this process (``runner`` None or ``mode="inprocess"``), as
    a subprocess (``launch``) or in its resident worker (``mode="resident"``: ``resident(inp,
    runner.workers)``, the launcher the caller hands in: ``rft_core.api.run_stage`` hands
    ``rft_core.workers.pool.run_resident``, since the workers sit above the stages); same result
    either way.

    Raises:
        ValueError: ``mode="resident"`` without a ``resident`` launcher.

    ``log`` receives the subprocess's output lines (unused in-process: the program logs
    through ``logging`` as usual). In-process (``run_in_process``), CUDA's TF32 matmuls are
    enabled first (``configure_cuda_backends``) and, after a program that holds a model, the CUDA
    cache is emptied (``release_models``; not in a resident worker that keeps it);
    ``python -m rft_core.stages`` enables TF32 at its start too (its memory goes back to the
    driver when it exits). With ``runner.keep_models`` the in-process program keeps and reuses
    models in memory (``rft_core.stages.memo``) and the CUDA cache is kept; a policy kept in
    memory only (``checkpoint.every`` > 1) that this process does not hold is rebuilt when a
    program asks for it (``rft_core.stages.recovery.keep_rebuilt``).
    """
    if runner is None or runner.mode == "inprocess":
        with keeping_models(runner is not None and runner.keep_models, rebuild=keep_rebuilt):
            return run_in_process(inp)
    if runner.mode == "resident":
        if resident is None:
            raise ValueError(f"stage {inp.program!r} runs in a resident worker (runner mode 'resident'), but no resident "
                             "launcher was handed in: call rft_core.api.run_stage, or pass "
                             "resident=rft_core.workers.pool.run_resident")
        assert runner.workers is not None  # RunnerConfig checks it
        return resident(inp, runner.workers)
    return launch(inp, runner, log=log)
