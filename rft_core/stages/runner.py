"""Run a stage program in the calling process or as ``python -m rft_core.stages <stage> ...``.

Both ways call the same function (``PROGRAMS[stage]``) with the same arguments, so they commit
the same shard under the same config hash; a subprocess is how a stage runs with another
interpreter (an environment with vLLM, which cannot share one with Prefect) or under torchrun
(a multi-rank DeepSpeed update). Arguments cross the process boundary as JSON, validated on the
other side against the program's own type hints (pydantic ``TypeAdapter``), so a ShardRef or a
config arrives as exactly the object that was sent.

Never imports prefect: the task hands in its run logger's ``info`` as the ``log`` callback.
"""
from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import typing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic import TypeAdapter

from rft_core.config import RunnerConfig
from rft_core.stages import advantages, critic, dynamic, logprobs, prompts, rewards, rollout, update
from schemas import ShardRef
from schemas.shards import ShardNotCommittedError, read_manifest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# stages whose program supports several ranks (torchrun with nproc_per_node > 1 or several nodes)
DISTRIBUTED_STAGES = frozenset({"ppo_update"})


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


@dataclass(frozen=True)
class Program:
    """A stage program: ``fn`` with ``fixed`` keyword arguments bound by the stage name, and
    ``defaults``: parameter -> TrainConfig attribute path, used by the CLI's ``--config``."""

    fn: Callable[..., Any]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def hints(self) -> dict[str, Any]:
        """Type hints of the free parameters and of ``return``."""
        hints = typing.get_type_hints(self.fn)
        return {k: v for k, v in hints.items() if k not in self.fixed}

    @property
    def params(self) -> list[str]:
        """Names of the parameters the caller supplies."""
        import inspect

        return [p for p in inspect.signature(self.fn).parameters if p not in self.fixed]

    def required(self) -> list[str]:
        """Parameters without a default."""
        import inspect

        sig = inspect.signature(self.fn).parameters
        return [p for p in self.params if sig[p].default is inspect.Parameter.empty]

    def __call__(self, **kwargs: Any) -> Any:
        unknown = sorted(set(kwargs) - set(self.params))
        if unknown:
            raise TypeError(f"unknown argument(s) {unknown}; this stage takes {self.params}")
        return self.fn(**self.fixed, **kwargs)


_TEMP = {"temperature": "rollout.temperature"}
PROGRAMS: dict[str, Program] = {
    "prompts": Program(prompts.run, defaults={"cfg": "data", "tokenizer_path": "policy.path"}),
    "rollout": Program(rollout.run, defaults={"cfg": "rollout", "policy": "policy.path", "dtype": "policy.dtype"}),
    "rollout_merge": Program(rollout.run_merge, defaults={"cfg": "rollout", "policy": "policy.path", "dtype": "policy.dtype"}),
    "actor_logprobs": Program(logprobs.run, {"stage": "actor_logprobs"},
                              {"cfg": "logprobs", "model": "policy.path", "dtype": "policy.dtype", **_TEMP}),
    "ref_logprobs": Program(logprobs.run, {"stage": "ref_logprobs"},
                            {"cfg": "logprobs", "model": "reference_model.path", "dtype": "reference_model.dtype", **_TEMP}),
    "rewards": Program(rewards.run, defaults={"cfg": "reward"}),
    "advantages": Program(advantages.run, defaults={"kl_cfg": "kl", "adv_cfg": "advantage", "shaping": "shaping",
                                                    "state": "initial_state", "max_new_tokens": "rollout.max_new_tokens"}),
    "critic_values": Program(critic.run_values, defaults={"cfg": "critic", "critic": "initial_critic"}),
    "critic_update": Program(critic.run_update, defaults={"cfg": "critic", "critic": "initial_critic"}),
    "ppo_update": Program(update.run, defaults={"cfg": "update", "kl_cfg": "kl", "policy": "policy.path",
                                                "dtype": "policy.dtype", **_TEMP}),
    "dynamic_merge": Program(dynamic.run_merge),
}


def program(stage: str) -> Program:
    """The program of ``stage``.

    Raises:
        KeyError: unknown stage; the message lists the valid names.
    """
    if stage not in PROGRAMS:
        raise KeyError(f"unknown stage {stage!r}; valid names: {', '.join(PROGRAMS)}")
    return PROGRAMS[stage]


def _allows_shardref(hint: Any) -> bool:
    return hint is ShardRef or any(_allows_shardref(a) for a in typing.get_args(hint))


def _is_committed_stage(value: str) -> bool:
    try:
        read_manifest(value)
    except (ShardNotCommittedError, OSError, ValueError):
        return False
    return True


def encode_args(stage: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-able form of a stage's arguments (ShardRefs and configs as dicts)."""
    prog = program(stage)
    unknown = sorted(set(kwargs) - set(prog.params))
    if unknown:
        raise TypeError(f"stage {stage!r}: unknown argument(s) {unknown}; it takes {prog.params}")
    return {k: TypeAdapter(prog.hints[k]).dump_python(v, mode="json") for k, v in kwargs.items()}


def decode_args(stage: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Validate JSON-decoded arguments against the program's type hints.

    A string given for a parameter that takes a ShardRef and naming a committed stage folder
    (one with a manifest) becomes that stage's ShardRef; for a policy (``str | ShardRef``) any
    other string stays a model path.

    Raises:
        TypeError: an unknown argument.
        pydantic.ValidationError: a value that does not fit the parameter's type (named).
    """
    prog = program(stage)
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in prog.hints:
            raise TypeError(f"stage {stage!r}: unknown argument {name!r}; it takes {prog.params}")
        hint = prog.hints[name]
        if isinstance(value, str) and _allows_shardref(hint) and _is_committed_stage(value):
            manifest, sha = read_manifest(value)
            value = ShardRef(uri=value, stage=manifest.stage, num_rows=manifest.num_rows,
                             config_hash=manifest.config_hash, manifest_sha256=sha)
        out[name] = TypeAdapter(hint).validate_python(value)
    return out


def encode_result(stage: str, result: Any) -> str:
    """JSON of a program's return value."""
    return TypeAdapter(program(stage).hints["return"]).dump_json(result).decode()


def decode_result(stage: str, text: str) -> Any:
    """Inverse of ``encode_result``."""
    return TypeAdapter(program(stage).hints["return"]).validate_json(text)


def stage_command(stage: str, args: Mapping[str, Any], runner: RunnerConfig, *, result_file: str) -> list[str]:
    """The command line of a stage subprocess: ``[python] -m rft_core.stages <stage> --arg k=<json> ...
    --result <file>``, wrapped in ``python -m torch.distributed.run`` for the torchrun launcher
    (``--standalone`` on one node unless ``torchrun_args`` give a rendezvous)."""
    python = runner.python or sys.executable
    prog = ["-m", "rft_core.stages", stage]
    for k, v in encode_args(stage, args).items():
        prog += ["--arg", f"{k}={json.dumps(v, separators=(',', ':'))}"]
    prog += ["--result", result_file]
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


def launch(stage: str, args: Mapping[str, Any], runner: RunnerConfig, *, log: Callable[[str], None] | None = None) -> Any:
    """Run ``stage`` as a subprocess and return what its program returned.

    Raises:
        StageProcessError: non-zero exit (exit code and the last output lines in the message),
            or an exit 0 without a result.
        ValueError: several ranks for a stage that does not support them.
    """
    ranks = runner.nproc_per_node if runner.launcher == "torchrun" else 1
    if (ranks > 1 or runner.torchrun_args) and stage not in DISTRIBUTED_STAGES:
        raise ValueError(f"stage {stage!r} runs on one rank only; torchrun with several ranks supports "
                         f"{sorted(DISTRIBUTED_STAGES)}")
    with tempfile.TemporaryDirectory(prefix=f"rft-{stage}-") as tmp:
        result_file = str(Path(tmp) / "result.json")
        cmd = stage_command(stage, args, runner, result_file=result_file)
        rc, tail = stream_process(cmd, env=subprocess_env(runner), log=log, tail_lines=runner.tail_lines)
        if rc != 0:
            raise StageProcessError(stage, rc, cmd, tail)
        if Path(result_file).exists():
            return decode_result(stage, Path(result_file).read_text())
        # multi-node: global rank 0 (which writes the result) may run on another node; the stage
        # committed its shard to shared storage, so read the ref from its manifest
        out = args.get("out")
        if isinstance(out, str) and _is_committed_stage(out):
            manifest, sha = read_manifest(out)
            return ShardRef(uri=out, stage=manifest.stage, num_rows=manifest.num_rows,
                            config_hash=manifest.config_hash, manifest_sha256=sha)
        raise StageProcessError(stage, rc, cmd, tail + ["(exit code 0 but no result was written)"])


def run_stage(stage: str, runner: RunnerConfig | None = None, *, log: Callable[[str], None] | None = None,
              **kwargs: Any) -> Any:
    """Run the program of ``stage`` with ``kwargs``: in this process (``runner`` None or
    ``mode="inprocess"``) or as a subprocess (``launch``); same result either way.

    ``log`` receives the subprocess's output lines (unused in-process: the program logs
    through ``logging`` as usual).
    """
    if runner is None or runner.mode == "inprocess":
        return program(stage)(**kwargs)
    return launch(stage, kwargs, runner, log=log)
