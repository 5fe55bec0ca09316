"""Partial rollouts through the training flow (issue 48, ``rollout.partial``): the demo preset at
tiny sizes with ``rollout.max_staleness=1``, ``rollout.partial.chunk_tokens=16`` and
``rollout.max_new_tokens=48``. The tiny model never emits EOS, so every response takes three
rollouts: the groups started in iteration k train in iteration k+2, iterations 1 and 2 train on
nothing (their updates commit the policy unchanged), and the rows of iterations 3, 4 and 5 hold
tokens of three rollouts each, sampled by versions (0, 0, 1), (0, 1, 2) and (1, 2, 3): versions
0-2 are the initial weights, version 3 the first that moved, so rollout 5 continues sequences
started by the initial weights under moved ones (a resident rollout worker that skipped a sync
would write other bytes). Two fresh runs, one
in stage mode and one with resident workers (a second stage-mode run without Ray), write the same
rollouts (rows and carry) byte for byte and end with the same weights bit for bit. The rewards
vary inside each group (``tests/varying.py``): the equality is asserted after non-zero advantages."""
from __future__ import annotations

import pytest
import torch

from rft_core.config import load_config
from schemas import read_manifest, read_shard, stage_uri
from tests.varying import assert_training_signal, policy_weights, reward_args
from tests.weights import iteration_policy_files

ITERATIONS = 5


def _demo(model: str, root, *extra: str):
    """configs/grpo_demo.yaml at tiny sizes, partial rollouts on, the varying reward (lr 1e-3 so that
    the policy versions differ enough for the correction to show)."""
    return load_config("configs/grpo_demo.yaml", [
        *reward_args(), "reward.format_reward=0.0", f"policy.path={model}", f"run_root={root}",
        f"iterations={ITERATIONS}", "data.prompts_per_iteration=2", "data.size=50", "rollout.batch_size=8",
        "rollout.max_new_tokens=48", "rollout.max_staleness=1", "rollout.partial.chunk_tokens=16",
        "logprobs.micro_batch_size=4", "update.micro_batch_size=4", "update.lr=1e-3",
        "checkpoint.keep_weights_last=4", *extra])  # version 2's weights stay for the checks below


def _files(root, stage: str, iteration: int = ITERATIONS, prefix: str = "") -> dict[str, str]:
    m, _ = read_manifest(stage_uri(str(root), iteration, stage))
    return {e.path: e.checksum for e in m.files if e.path.startswith(prefix)}


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_two_partial_runs_are_bit_identical_and_tokens_span_versions(prefect_harness, tiny_model, tmp_path):
    from flows.train import train

    a = train(_demo(tiny_model, tmp_path / "a"))
    # what the equality below is about: real policy-gradient updates in the iterations that train
    assert_training_signal(tmp_path / "a", (3, 4))
    rows = {k: read_shard(stage_uri(str(tmp_path / "a"), k, "rollout"), stage="rollout") for k in range(1, ITERATIONS + 1)}
    assert [rows[k].num_rows for k in range(1, ITERATIONS + 1)] == [0, 0, 8, 8, 8]
    for k, spans in ((3, [0, 0, 1]), (4, [0, 1, 2]), (5, [1, 2, 3])):  # v(k) = max(0, k - 2), a chunk of 16 each
        versions = rows[k].column("token_versions").to_pylist()
        assert versions == [[v for v in spans for _ in range(16)]] * 8
        assert all(len(set(v)) > 1 for v in versions)  # the per-token version varies within every row
    m = {r["iteration"]: r for r in a.metrics}
    assert [m[k]["partial_finished_groups"] for k in (1, 2, 3, 4, 5)] == [0, 0, 2, 2, 2]
    assert [m[k]["multi_version_frac"] for k in (3, 4)] == [1.0, 1.0] and m[4]["token_staleness_max"] == 3
    # nothing finished in iterations 1 and 2: no optimizer step, the initial weights committed as versions 1 and 2
    # (version 1's weights are pruned by now: checkpoint.keep_weights_last 4)
    initial = policy_weights(stage_uri(str(tmp_path / "a"), 2, "ppo_update"))
    for k in (1, 2):
        assert read_manifest(stage_uri(str(tmp_path / "a"), k, "ppo_update"))[0].summary["optimizer_steps"] == 0
    from rft_core.models.loading import load_causal_lm

    base = {n: t.detach().float() for n, t in load_causal_lm(tiny_model).state_dict().items()}
    assert all(torch.equal(initial[n], base[n]) for n in base)
    # the correction by token age. Iteration 3 trains tokens of versions 0 and 1 from version 2: all three are the
    # initial weights (updates 1 and 2 trained nothing), so every weight is 1 to rounding. Iteration 4 trains tokens
    # of versions 0, 1, 2 (still the initial weights) from version 3, which update 3 moved: staleness 3, 2, 1
    assert [abs(m[3][f"rollout_is_weight_mean_staleness_{d}"] - 1.0) < 1e-5 for d in (1, 2)] == [True, True]
    moved = [abs(m[4][f"rollout_is_weight_mean_staleness_{d}"] - 1.0) for d in (1, 2, 3)]
    assert min(moved) > 1e-5 and max(moved) > 5e-4, moved
    # rollout 5 sampled its last 16 tokens with version 3 (moved by update 3) after versions 1 and 2 (the initial
    # weights) sampled the first 32: its rollout log-probs are version 3's there and the initial model's before
    from rft_core.models.logprobs import batched_response_logprobs
    from tests.weights import iteration_policy_folder

    r5 = rows[5].to_pydict()
    version_3 = load_causal_lm(str(iteration_policy_folder(tmp_path / "a", 3)))
    assert not all(torch.equal(t.float(), base[n]) for n, t in version_3.state_dict().items())
    def scored(model):  # at the demo's sampling temperature, as the engine reports them
        return batched_response_logprobs(model, r5["prompt_token_ids"], r5["response_token_ids"], pad_token_id=2,
                                         temperature=0.7)

    def gap(logprobs, span):
        return max(abs(a - b) for x, y in zip(logprobs, r5["rollout_logprobs"]) for a, b in zip(x[span], y[span]))

    by_initial = scored(load_causal_lm(tiny_model))
    assert gap(scored(version_3), slice(32, 48)) < 2e-4 and gap(by_initial, slice(0, 32)) < 2e-4
    assert gap(by_initial, slice(32, 48)) > 1e-4  # version 3 really is another policy there

    # a second run, with resident workers (checkpoint every 5: the rollout worker continues the carried sequences, the
    # policy worker keeps the weights in memory): every rollout (rows and carry) the same bytes, the same weights.
    # Without Ray, a second stage-mode run
    try:
        import ray  # noqa: F401

        extra: tuple[str, ...] = ("orchestration.workers=resident", f"checkpoint.every={ITERATIONS}")
    except ImportError:
        extra = ()
    train(_demo(tiny_model, tmp_path / "b", *extra))
    for k in range(1, ITERATIONS + 1):
        assert _files(tmp_path / "a", "rollout", k) == _files(tmp_path / "b", "rollout", k), k
    # the final checkpoint where each run wrote it (a resident one in the background: ppo_update-policy)
    assert iteration_policy_files(tmp_path / "a", ITERATIONS) == iteration_policy_files(tmp_path / "b", ITERATIONS)
    assert iteration_policy_files(tmp_path / "a", ITERATIONS)
