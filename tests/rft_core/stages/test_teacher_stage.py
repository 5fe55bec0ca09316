"""The teacher_logprobs stage (on-policy distillation): its committed shard equals a direct float64
forward pass of the teacher over [prompt | response]; a teacher whose tokenizer maps tokens to
other ids is refused, naming both paths, before anything is computed or committed; the advantages
stage turns the column group into the signal; the input is built from a config as the command
line builds it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rft_core.config import GRPOAdvantage, KLConfig, LogprobConfig, TeacherConfig, TrainState, load_config
from rft_core.models.loading import load_causal_lm
from rft_core.stages import advantages as adv_stage
from rft_core.stages.contracts import AdvantagesInput, TeacherLogprobsInput
from rft_core.stages.runner import INPUTS, PROGRAMS, run_stage
from rft_core.stages.teacher import TeacherTokenizerError, check_teacher_tokenizer
from schemas import read_manifest, read_shard, write_shard
from schemas.batch import join_column_groups
from schemas.columns import REWARDS, ROLLOUT, policy_version_column, single_turn_columns
from tests.tiny import build_tiny_model

PROMPT_IDS = ["a", "a", "b", "b"]
LENGTHS = [4, 2, 5, 3]
MASKS = [[True] * 4, [True, True], [True, True, False, True, True], [True] * 3]  # row 2: an observation token
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A tiny random Llama with other weights than ``tiny_model`` and the same tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


@pytest.fixture(scope="module")
def other_tokenizer(teacher, tmp_path_factory) -> str:
    """The teacher with a tokenizer of the same size whose ids of 't' and 'u' are swapped."""
    out = tmp_path_factory.mktemp("swapped") / "model"
    shutil.copytree(teacher, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["t"], vocab["u"] = vocab["u"], vocab["t"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return str(out)


def _rollout(tmp_path: Path):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (3,), generator=g).tolist() for _ in PROMPT_IDS]
    responses = [torch.randint(3, 400, (n,), generator=g).tolist() for n in LENGTHS]
    ids = [f"s{i}" for i in range(len(PROMPT_IDS))]
    table = pa.table({
        "sample_id": ids, "prompt_id": PROMPT_IDS, "sample_index": [0, 1, 0, 1], "prompt_token_ids": prompts,
        "response_token_ids": responses, "response_text": ["x"] * 4,
        "rollout_logprobs": [[-1.0 - 0.1 * t for t in range(n)] for n in LENGTHS], "action_mask": MASKS,
        "finish_reason": ["stop"] * 4, "images": [[]] * 4, "videos": [[]] * 4,
        **single_turn_columns(["x"] * 4), **policy_version_column(4, 0),
    }, schema=ROLLOUT.arrow)
    return write_shard(table, str(tmp_path / "rollout"), schema=ROLLOUT, config_hash="h"), prompts, responses


def _float64_logprobs(model_path: str, prompts, responses, temperature: float) -> list[list[float]]:
    model = load_causal_lm(model_path).to(torch.float64)
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1] / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0].tolist())
    return out


def test_committed_shard_equals_a_float64_forward_pass_of_the_teacher(tiny_model, teacher, tmp_path):
    rollout, prompts, responses = _rollout(tmp_path)
    inp = TeacherLogprobsInput(rollout=rollout, model=teacher, logprobs=LogprobConfig(micro_batch_size=3),
                               temperature=TEMPERATURE, tokenizer_path=tiny_model, out=str(tmp_path / "teacher_logprobs"))
    ref = run_stage(inp)
    manifest, _ = read_manifest(ref.uri)
    assert manifest.stage == "teacher_logprobs" and manifest.contract == "teacher_logprobs v1"
    assert manifest.inputs == {"rollout": rollout.manifest_sha256}
    got = read_shard(ref, stage="teacher_logprobs").column("teacher_logprobs").to_pylist()
    want = _float64_logprobs(teacher, prompts, responses, TEMPERATURE)
    assert [len(x) for x in got] == LENGTHS
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), atol=2e-5, rtol=0)
    # the teacher is not the student: its log-probs of the same tokens differ
    student = _float64_logprobs(tiny_model, prompts, responses, TEMPERATURE)
    assert max(abs(a - b) for s, w in zip(student, want) for a, b in zip(s, w)) > 1e-2
    assert run_stage(inp).manifest_sha256 == ref.manifest_sha256  # committed: returned as is

    # the advantages stage: the signal teacher.coef * (log nu - log pi_old) alone on the action tokens
    rewards = write_shard(pa.table({
        "sample_id": [f"s{i}" for i in range(4)], "prompt_id": PROMPT_IDS, "rewards": [1.0, 0.0, 1.0, 1.0],
        "correct": [True, False, True, True], "extracted_answer": ["1"] * 4, "reward_metrics": [[]] * 4,
        "reward_reasons": [[]] * 4}, schema=REWARDS.arrow), str(tmp_path / "rewards"), schema=REWARDS, config_hash="h")
    distill = TeacherConfig(path=teacher, coef=0.5, use_task_rewards=False)
    adv = adv_stage.run(AdvantagesInput(rollout=rollout, rewards=rewards, teacher_logprobs=ref, teacher=distill,
                                        kl=KLConfig(), advantage=GRPOAdvantage(), state=TrainState(),
                                        out=str(tmp_path / "advantages")))
    rows = read_shard(adv).to_pylist()
    old = [[-1.0 - 0.1 * t for t in range(n)] for n in LENGTHS]  # the rollout's log-probs (no actor stage)
    for row, g, o, m in zip(rows, got, old, MASKS):
        expect = [0.5 * (gt - ot) if k else 0.0 for gt, ot, k in zip(g, o, m)]
        assert row["advantages"] == pytest.approx(expect, abs=1e-6) and row["returns"] == pytest.approx(expect, abs=1e-6)
    # added to the task reward's advantage: GRPO's advantages plus the signal, token by token
    batch = join_column_groups(read_shard(rollout), rewards=read_shard(rewards), teacher_logprobs=read_shard(ref))
    task = adv_stage.compute_advantages(batch, kl_cfg=KLConfig(), adv_cfg=GRPOAdvantage())["advantages"]
    both = adv_stage.compute_advantages(batch, kl_cfg=KLConfig(), adv_cfg=GRPOAdvantage(),
                                        teacher=distill.model_copy(update={"use_task_rewards": True}))["advantages"]
    signal = torch.tensor([[0.5 * (gt - ot) if k else 0.0 for gt, ot, k in zip(g, o, m)] + [0.0] * (5 - len(g))
                           for g, o, m in zip(got, old, MASKS)])
    assert task.abs().max() > 0.5
    torch.testing.assert_close(both, task + signal, atol=1e-6, rtol=0)
    summary, _ = read_manifest(adv.uri)
    assert summary.inputs["teacher_logprobs"] == ref.manifest_sha256
    assert summary.summary["distill_reverse_kl"] == pytest.approx(
        sum(ot - gt for g, o, m in zip(got, old, MASKS) for gt, ot, k in zip(g, o, m) if k) / sum(map(sum, MASKS)), abs=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model, other_tokenizer, tmp_path):
    assert "(49152 tokens)" in check_teacher_tokenizer(tiny_model, tiny_model)
    with pytest.raises(TeacherTokenizerError) as info:
        check_teacher_tokenizer(tiny_model, other_tokenizer)
    msg = str(info.value)
    assert f"teacher.path {other_tokenizer!r}" in msg and f"policy.path {tiny_model!r}" in msg
    assert "49152 vs 49152 tokens" in msg and "token 't' is id 100 in the policy's and id 101 in the teacher's" in msg
    # the stage refuses it before reading the rollout or computing anything: nothing is committed
    rollout, _, _ = _rollout(tmp_path)
    out = tmp_path / "teacher_logprobs"
    with pytest.raises(TeacherTokenizerError, match="another tokenizer"):
        run_stage(TeacherLogprobsInput(rollout=rollout, model=other_tokenizer, logprobs=LogprobConfig(), temperature=1.0,
                                       tokenizer_path=tiny_model, out=str(out)))
    assert not (out / "_MANIFEST.json").exists()


def test_an_added_token_is_named(tiny_model, teacher, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "added"
    shutil.copytree(teacher, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<tool_result>"])
    tok.save_pretrained(out)
    with pytest.raises(TeacherTokenizerError, match=r"49153 vs 49152 tokens; token '<tool_result>' \(id 49152\) is in "
                                                    r"the teacher's only"):
        check_teacher_tokenizer(tiny_model, str(out))


def test_the_preset_wires_the_teacher_stage_as_the_command_line_builds_it():
    """configs/distill_demo.yaml loads, distillation is on, and the teacher and advantages inputs
    are filled from it through their config_paths (``python -m rft_core.stages ... --config``)."""
    from rft_core.stages.__main__ import _parser, _raw_input
    from rft_core.stages.runner import input_from_args

    cfg = load_config("configs/distill_demo.yaml")
    assert cfg.teacher.enabled and not cfg.teacher.use_task_rewards and cfg.kl.kl_coef == 0
    assert cfg.runner("teacher_logprobs").mode == "inprocess" and "teacher_logprobs" in PROGRAMS
    refs = {"rollout": {"uri": "memory://x/r", "stage": "rollout", "num_rows": 1, "config_hash": "h",
                        "manifest_sha256": "a" * 64}}
    ns = _parser(list(PROGRAMS)).parse_args(["teacher_logprobs", "--config", "configs/distill_demo.yaml", "--out", "o",
                                             "--arg", f"rollout={json.dumps(refs['rollout'])}"])
    inp = input_from_args("teacher_logprobs", _raw_input(ns, dict(INPUTS["teacher_logprobs"].config_paths)))
    assert (inp.model, inp.dtype, inp.temperature, inp.tokenizer_path) == (cfg.teacher.path, "float32", 1.0, cfg.policy.path)
    ns = _parser(list(PROGRAMS)).parse_args(["advantages", "--config", "configs/distill_demo.yaml", "--out", "o",
                                             "--arg", f"rollout={json.dumps(refs['rollout'])}",
                                             "--arg", f"rewards={json.dumps(refs['rollout'])}",
                                             "--arg", f"teacher_logprobs={json.dumps(refs['rollout'])}"])
    adv = input_from_args("advantages", _raw_input(ns, dict(INPUTS["advantages"].config_paths)))
    assert adv.teacher == cfg.teacher
    # without distillation the teacher section enters no advantages hash (None), as before it existed
    plain = load_config("configs/grpo_demo.yaml")
    ns = _parser(list(PROGRAMS)).parse_args(["advantages", "--config", "configs/grpo_demo.yaml", "--out", "o",
                                             "--arg", f"rollout={json.dumps(refs['rollout'])}",
                                             "--arg", f"rewards={json.dumps(refs['rollout'])}"])
    adv = input_from_args("advantages", _raw_input(ns, dict(INPUTS["advantages"].config_paths)))
    assert adv.teacher is None and not plain.teacher.enabled and "teacher" not in adv.hash_view()
    with pytest.raises(ValueError, match="teacher_logprobs .* and teacher .* go together"):
        AdvantagesInput.model_validate({**adv.model_dump(), "teacher": cfg.teacher.model_dump()})
