"""Stage programs as subprocesses (``python -m rft_core.stages``): the same shard as in-process,
failures raise with the exit code and the last lines, output lines stream to the callback."""
from __future__ import annotations

import json
import sys
import time

import pytest

from rft_core.config import RunnerConfig, load_config
from rft_core.stages import prompts as prompts_stage
from rft_core.stages.contracts import ActorLogprobsInput, AdvantagesInput, PPOUpdateInput, PromptsInput, RolloutInput
from rft_core.stages.runner import StageProcessError, input_from_args, run_stage, stage_command, stream_process
from schemas import ShardRef, read_manifest


def _cfg(tiny_model, tmp_path):
    return load_config(None, {"policy.path": tiny_model, "data.prompts_per_iteration": 2, "data.size": 20,
                              "rollout.n_samples_per_prompt": 2, "rollout.max_new_tokens": 5, "rollout.batch_size": 4})


def _files(uri):
    m, _ = read_manifest(uri)
    return m.config_hash, [(f.path, f.bytes, f.checksum) for f in m.files]


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_subprocess_stage_commits_the_same_shard_as_in_process(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path)
    p = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "prompts")))
    inp = RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, dtype="float32", out=str(tmp_path / "a"))
    a = run_stage(inp)
    lines: list[str] = []
    b = run_stage(inp.model_copy(update={"out": str(tmp_path / "b")}), RunnerConfig(mode="subprocess"), log=lines.append)
    assert isinstance(b, ShardRef) and b.uri == str(tmp_path / "b") and b.num_rows == a.num_rows == 4
    assert b.config_hash == a.config_hash
    assert _files(b.uri) == _files(a.uri)  # byte-identical parts: same sizes and checksums
    assert any("rollout committed" in line for line in lines), lines
    # the actor log-prob stage through the CLI with --config and a stage URI instead of ShardRef JSON
    want = run_stage(ActorLogprobsInput(rollout=a, model=tiny_model, logprobs=cfg.logprobs, temperature=1.0,
                                        out=str(tmp_path / "lp_a"), dtype="float32"))
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    cmd = [sys.executable, "-m", "rft_core.stages", "actor_logprobs", "--config", str(tmp_path / "cfg.json"),
           "--arg", f"rollout={a.uri}", "--out", str(tmp_path / "lp_b"), "--result", str(tmp_path / "res.json")]
    from rft_core.stages.runner import subprocess_env

    rc, tail = stream_process(cmd, env=subprocess_env(RunnerConfig(mode="subprocess")), log=None, tail_lines=20)
    assert rc == 0, "\n".join(tail)
    got = ShardRef.model_validate_json((tmp_path / "res.json").read_text())
    assert got.config_hash == want.config_hash and _files(got.uri) == _files(want.uri)


def test_a_log_prob_pass_from_the_command_line_takes_its_iterations_grouping(tmp_path, capsys):
    """``python -m rft_core.stages actor_logprobs --config ... --iteration K``: below float32 the
    pass packs the rows of iteration K's update (``logprob_grouping_at(K)``: policy version K - 1
    in its shuffle seed), which the flow hands each iteration; without --iteration such a config
    is a usage error (iteration 1's rows would be packed silently); in float32 nothing is needed.
    ``--iteration`` also fills a program's own ``iteration`` field."""
    from rft_core.stages.__main__ import _parser, _raw_input
    from rft_core.stages.runner import INPUTS, PROGRAMS

    def raw(stage, *args, dtype="bfloat16"):
        cfg = tmp_path / f"{dtype}.yaml"
        cfg.write_text(f"policy:\n  dtype: {dtype}\nupdate:\n  micro_batch_size: 3\n")
        ns = _parser(list(PROGRAMS)).parse_args([stage, "--config", str(cfg), "--arg", "rollout=r", *args])
        return _raw_input(ns, dict(INPUTS[stage].config_paths))

    bf16 = load_config(None, ["policy.dtype=bfloat16", "update.micro_batch_size=3"])
    for stage in ("actor_logprobs", "ref_logprobs"):
        got = raw(stage, "--iteration", "3")["grouping"]
        assert got == bf16.logprob_grouping_at(3).model_dump(mode="json") and got["policy_version"] == 2
        assert got != bf16.logprob_grouping_at(1).model_dump(mode="json")
        assert raw(stage) is None and "give --iteration K" in capsys.readouterr().err
        assert raw(stage, "--arg", 'grouping={"not": 1}')["grouping"] == {"not": 1}  # given by hand: taken as is
    assert raw("actor_logprobs", dtype="float32")["grouping"] is None
    ns = _parser(list(PROGRAMS)).parse_args(["rollout", "--iteration", "4"])
    assert _raw_input(ns, dict(INPUTS["rollout"].config_paths))["iteration"] == 4
    # a stage it would not change is a usage error, and so is an iteration below 1
    ns = _parser(list(PROGRAMS)).parse_args(["ppo_update", "--iteration", "3"])
    assert _raw_input(ns, dict(INPUTS["ppo_update"].config_paths)) is None
    assert "ppo_update does not take it" in capsys.readouterr().err
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            _parser(list(PROGRAMS)).parse_args(["rollout", "--iteration", bad])


def test_failing_subprocess_raises_with_exit_code_and_last_lines(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path)
    ghost = ShardRef(uri=str(tmp_path / "nowhere"), stage="prompts", num_rows=1, config_hash="x", manifest_sha256="y")
    with pytest.raises(StageProcessError) as info:
        run_stage(RolloutInput(prompts=ghost, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=str(tmp_path / "r")),
                  RunnerConfig(mode="subprocess", tail_lines=5))
    err = info.value
    assert err.returncode == 1 and len(err.tail) <= 5
    assert "exit code 1" in str(err) and "ShardNotCommittedError" in str(err) and "nowhere" in str(err)


def test_exit_code_and_signal_are_reported(tmp_path):
    code = "import sys\nfor i in range(50): print('line', i)\nsys.exit(3)"
    rc, tail = stream_process([sys.executable, "-c", code], env={}, log=None, tail_lines=4)
    assert rc == 3 and tail == ["line 46", "line 47", "line 48", "line 49"]
    err = StageProcessError("rollout", -9, ["python"], ["x"])
    assert "exit code -9 (killed by SIGKILL)" in str(err)


def test_lines_stream_to_the_callback_while_the_process_runs(tmp_path):
    flag = tmp_path / "flag"
    # the child prints 'first', then waits for the callback to have seen it before printing 'second'
    code = (f"import pathlib, sys, time\nprint('first')\nt = time.time()\n"
            f"while not pathlib.Path({str(flag)!r}).exists():\n"
            f"    time.sleep(0.01)\n    if time.time() - t > 10: sys.exit(7)\n"
            f"print('second', file=sys.stderr)\n")
    seen: list[tuple[str, float]] = []

    def log(line):
        seen.append((line, time.time()))
        if line == "first":
            flag.write_text("seen")

    # unbuffered, as subprocess_env sets it: a buffering child would print nothing until it exits
    rc, _ = stream_process([sys.executable, "-c", code], env={"PYTHONUNBUFFERED": "1"}, log=log, tail_lines=10)
    assert rc == 0 and [s for s, _ in seen] == ["first", "second"]  # stderr arrives too


def test_inputs_round_trip_through_json(tiny_model, tmp_path):
    cfg = load_config(None, {"advantage.estimator": "rloo", "kl.kl_coef": 0.1})
    ref = ShardRef(uri="memory://x/rollout", stage="rollout", num_rows=3, config_hash="abc", manifest_sha256="d" * 64)
    inp = AdvantagesInput(rollout=ref, rewards=ref, ref_logprobs=ref, kl=cfg.kl, advantage=cfg.advantage,
                          shaping=cfg.shaping, state=cfg.initial_state, max_new_tokens=7, out="memory://x/adv")
    back = input_from_args("advantages", json.loads(inp.model_dump_json()))
    assert back == inp and back.config_hash() == inp.config_hash()
    with pytest.raises(ValueError, match="bogus"):
        input_from_args("advantages", {**json.loads(inp.model_dump_json()), "bogus": 1})
    upd = PPOUpdateInput(rollout=ref, advantages=ref, policy="p", update=cfg.update, kl=cfg.kl, temperature=1.0, out="x")
    cmd = stage_command(upd, RunnerConfig(mode="subprocess", launcher="torchrun", nproc_per_node=2),
                        input_file="i.json", result_file="r.json")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert cmd[5:] == ["-m", "rft_core.stages", "ppo_update", "--input", "i.json", "--result", "r.json"]
    with pytest.raises(ValueError, match="runs on one rank only"):
        run_stage(RolloutInput(prompts=ref, policy="p", rollout=cfg.rollout, iteration=1, out="x"),
                  RunnerConfig(mode="subprocess", launcher="torchrun", nproc_per_node=2))


@pytest.mark.rotation(6)  # long: one turn in 8 (tests/rotation.py); test_stage_tasks.py's runner runs every time
def test_interpreter_wrapper_and_result_read_back_from_the_manifest(tiny_model, tmp_path):
    """``runner.python`` may be a wrapper (srun, a container): here one that drops --result, as
    when global rank 0 runs on another node; the launcher reads the committed manifest instead."""
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"""#!/bin/sh
# drop '--result FILE' (the last two arguments) and run the real interpreter
n=$#; i=0
for a in "$@"; do i=$((i+1)); [ $i -le $((n-2)) ] && set -- "$@" "$a"; done
shift $n
echo "wrapper ran: $*"
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    cfg = _cfg(tiny_model, tmp_path)
    lines: list[str] = []
    ref = run_stage(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p")),
                    RunnerConfig(mode="subprocess", python=str(wrapper)), log=lines.append)
    assert lines[0].startswith("wrapper ran: -m rft_core.stages prompts") and "--result" not in lines[0]
    assert ref.uri == str(tmp_path / "p") and ref.num_rows == 2
    assert ref.manifest_sha256 == read_manifest(ref.uri)[1]


def test_scale_example_config_is_valid():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs/grpo_scale.yaml")
    assert cfg.rollout.engine == "vllm" and cfg.update.deepspeed.zero_stage == 3
    assert cfg.runner("rollout").shards == 8 and cfg.runner("ppo_update").launcher == "torchrun"
    ref = ShardRef(uri="s3://b/r", stage="rollout", num_rows=3, config_hash="abc", manifest_sha256="d" * 64)
    upd = PPOUpdateInput(rollout=ref, advantages=ref, policy="p", update=cfg.update, kl=cfg.kl, temperature=1.0, out="s3://b/x")
    cmd = stage_command(upd, cfg.runner("ppo_update"), input_file="i.json", result_file="r.json")
    assert "--standalone" not in cmd and "--nnodes=2" in cmd and cmd[0] == "/opt/prefect-rft/.venv-gpu/bin/python"
