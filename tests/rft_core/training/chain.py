"""What the multi-rank update tests share (DeepSpeed ZeRO, FSDP2; ``conftest.py`` builds the
session fixtures from it): the torchrun runner of 2 CPU ranks, the update inputs (a rollout of 10
samples with +-1 advantages) and helpers to run an update and compare weights."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rft_core.config import DeepSpeedConfig, FSDPConfig, KLConfig, RunnerConfig, UpdateConfig
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.stages.contracts import PPOUpdateInput
from rft_core.stages.runner import run_stage
from schemas import write_shard
from schemas.columns import ADVANTAGES, ROLLOUT, policy_version_column, single_turn_columns
from tests.varying import assert_shard_advantages_nonzero, assert_update_signal

RUNNER = RunnerConfig(mode="subprocess", launcher="torchrun", nproc_per_node=2, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
ITERATIONS = 3


@contextlib.contextmanager
def one_thread():
    """Torch on one thread, as in the ranks (RUNNER's OMP_NUM_THREADS=1): CPU kernels round
    differently with another thread count, and AdamW turns that into weight differences of
    ~7e-6 after 4 steps where a weight's micro-batch gradients nearly cancel (measured: 2
    threads 7.0e-6, 1 thread 1.2e-7, on the ZeRO-2 update of test_deepspeed_update.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_update_inputs(tiny_model: str, root: Path):
    """(root, rollout ref, advantages ref, UpdateConfig, the single-process update's ref): a rollout
    of 10 samples (old log-probs from the model itself), +-1 advantages, and the first
    single-process update on them (one thread, as the ranks)."""
    g = torch.Generator().manual_seed(7)
    n = 10
    prompts = [torch.randint(3, 500, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 500, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    old = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    ids = [f"p{i // 2}#{i % 2}" for i in range(n)]
    rollout = pa.table({"sample_id": ids, "prompt_id": [s.split("#")[0] for s in ids], "sample_index": [i % 2 for i in range(n)],
                        "prompt_token_ids": prompts, "response_token_ids": responses, "response_text": [""] * n,
                        "rollout_logprobs": old, "action_mask": [[True] * len(r) for r in responses],
                        "finish_reason": ["length"] * n, "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)],
                        **single_turn_columns([""] * n), **policy_version_column(n, 0)},
                       schema=ROLLOUT.arrow)
    adv = [[1.0 if i % 3 else -1.0] * len(r) for i, r in enumerate(responses)]
    advantages = pa.table({"sample_id": ids, "prompt_id": [s.split("#")[0] for s in ids], "shaped_rewards": [0.0] * n,
                           "kl": [[0.0] * len(r) for r in responses], "advantages": adv, "returns": adv},
                          schema=ADVANTAGES.arrow)
    r = write_shard(rollout, str(root / "rollout"), schema=ROLLOUT, config_hash="r")
    a = write_shard(advantages, str(root / "advantages"), schema=ADVANTAGES, config_hash="a")
    # 2 epochs of mini-batches of 5 in micro-batches of 2: 3 micro-batches per step over 2 ranks
    cfg = UpdateConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, max_grad_norm=1.0)
    with one_thread():  # the kernels of the ranks (OMP_NUM_THREADS=1)
        single = run_stage(PPOUpdateInput(rollout=r, advantages=a, policy=tiny_model, update=cfg, kl=KLConfig(),
                                          temperature=1.0, out=str(root / "single")))
    # what every equality test compares is a real policy-gradient update (issue 39)
    assert_shard_advantages_nonzero(a)
    assert_update_signal(single)
    return root, r, a, cfg, single


def weights(uri):
    """The ``policy/`` weights of a committed update."""
    return load_causal_lm(f"{uri}/policy").state_dict()


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def run_update(update_inputs, policy, cfg: UpdateConfig, out: str, runner: RunnerConfig | None = None,
               lines: list[str] | None = None, **kw):
    """One ``ppo_update`` of ``policy`` on the shared inputs into ``{root}/{out}`` (its log lines into ``lines``)."""
    root, r, a = update_inputs[:3]
    inp = PPOUpdateInput(rollout=r, advantages=a, policy=policy, update=cfg, kl=KLConfig(), temperature=1.0,
                         out=str(root / out), **kw)
    return run_stage(inp, runner, log=(lines.append if lines is not None else None))


def ds(cfg: UpdateConfig, zero_stage: int) -> UpdateConfig:
    """``cfg`` under DeepSpeed ZeRO ``zero_stage``."""
    return cfg.model_copy(update={"deepspeed": DeepSpeedConfig(zero_stage=zero_stage)})


def fsdp(cfg: UpdateConfig, **kw) -> UpdateConfig:
    """``cfg`` under FSDP2 (``FSDPConfig(**kw)``)."""
    return cfg.model_copy(update={"fsdp": FSDPConfig(**kw)})


def random_head_critic(tiny_model: str, rollout, root: Path) -> tuple[str, object, dict[str, torch.Tensor]]:
    """(folder, values ref, its weights): a critic of the tiny model with a random value head
    (a fresh critic's head is zero, so its backbone's first gradient is exactly 0 and every value
    0 whatever the sharding or the alignment) and the ``critic_values`` shard of its own values on
    ``rollout``: the multi-rank critic tests train a critic whose every weight has a gradient."""
    from rft_core.models.critic import batched_response_values, load_critic
    from rft_core.models.loading import load_tokenizer
    from schemas import read_shard
    from schemas.columns import CRITIC_VALUES

    critic = load_critic(tiny_model)
    with torch.no_grad():
        critic.score.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    folder = root / "random-head-critic"
    critic.save_pretrained(folder)
    load_tokenizer(tiny_model).save_pretrained(folder)
    rows = read_shard(rollout).to_pydict()
    values = batched_response_values(critic, rows["prompt_token_ids"], rows["response_token_ids"], pad_token_id=2)
    assert max(abs(v) for row in values for v in row) > 0.1
    ref = write_shard(pa.table({"sample_id": rows["sample_id"], "values": values}, schema=CRITIC_VALUES.arrow),
                      str(root / "random-head-values"), schema=CRITIC_VALUES, config_hash="v")
    return str(folder), ref, {k: v.clone() for k, v in critic.state_dict().items()}


def critic_chain(update_inputs, critic: str, values, cfg, prefix: str, runner: RunnerConfig | None = None,
                 iterations: int = 2) -> list:
    """``iterations`` critic updates on the shared inputs, each continuing the previous one's
    committed critic (its weights and AdamW state), into ``{root}/{prefix}{i}``; one process
    (``runner`` None: on one thread, as the ranks) or ``runner``'s torchrun job."""
    from rft_core.stages.contracts import CriticUpdateInput

    root, r, a = update_inputs[:3]
    refs, model = [], critic
    for i in range(1, iterations + 1):
        inp = CriticUpdateInput(rollout=r, advantages=a, critic_values=values, model=model, critic=cfg,
                                out=str(root / f"{prefix}{i}"))
        if runner is None:
            with one_thread():
                model = run_stage(inp)
        else:
            model = run_stage(inp, runner)
        refs.append(model)
    return refs


def assert_critic_chain_continues(single: list, sharded: list, *, start: dict, restarted, files: list[str],
                                  state: dict, tol: float) -> None:
    """``sharded`` (a DeepSpeed or FSDP2 ``critic_chain``) gives the single-process chain's losses,
    gradient norms and weights (within ``tol``) at every update, its every update but the first
    continued the previous one's sharded AdamW state (``critic-optimizer/``: ``files``, and the
    manifest's ``optimizer`` summary holding ``state``), and ``restarted`` (the second update
    with AdamW afresh) differs from it by more than ``tol``: the state carried over mattered."""
    from rft_core.models.critic import load_critic
    from schemas import read_manifest, read_shard

    def critic_weights(ref):
        return load_critic(f"{ref.uri}/critic").state_dict()

    for i, (want_ref, got_ref) in enumerate(zip(single, sharded), start=1):
        want, got = read_shard(want_ref.uri).to_pydict(), read_shard(got_ref.uri).to_pydict()
        assert len(got["step"]) == 4 and got["num_tokens"] == want["num_tokens"], i
        assert min(want["grad_norm"]) > 1e-3, i
        assert got["value_loss"] == pytest.approx(want["value_loss"], abs=1e-6), i
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), i
        manifest = read_manifest(got_ref.uri)[0]
        assert {k: manifest.summary["optimizer"][k] for k in state} == state, i
        # (DeepSpeed also writes its conversion scripts, zero_to_*.py, which vary with its version)
        assert sorted(f.path for f in manifest.files if f.path.startswith("critic-optimizer/")
                      and not f.path.rpartition("/")[2].startswith("zero_to_")) == files, i
        assert max_diff(critic_weights(got_ref), critic_weights(want_ref)) < tol, i
    w1, w2 = critic_weights(single[0]), critic_weights(single[1])
    assert max((w1[k] - start[k]).abs().max().item() for k in w1 if not k.startswith("score")) > 1e-4  # backbone moved
    assert max_diff(w2, w1) > 1e-4  # the second update trained on
    assert max_diff(critic_weights(restarted), w2) > 10 * tol  # AdamW afresh would have ended elsewhere


def resident_critic_gang(update_inputs, tiny_model: str, tmp_path: Path, cfg, prefix: str) -> tuple[list, list]:
    """(the gang's refs, the torchrun chain's refs): three updates of a random-head critic
    (``random_head_critic``) under ``cfg`` (a DeepSpeed or FSDP2 ``CriticConfig``) by ``RUNNER``'s
    torchrun jobs, and by a resident critic gang of 2 ranks (``orchestration.critic_ranks=2``, Ray
    actors on one thread each), with a values pass on the gang between its first two updates,
    and the third on a new gang (the old one stopped, as after a rank died), which continues
    from the committed critic and its sharded AdamW state (``critic-optimizer/``). Asserts
    what holds for any sharding: equal losses and critic weights at each update, bit for bit; the
    gang's values pass (rank 0 alone, from storage) equal to one process's values from the first
    torchrun update's checkpoint, bit for bit, and not the start's; after the first update no
    model load but rank 0's one for the values pass (``model_loads``: the second update
    continued the held shards), both ranks holding the second update; each update continued the
    one before; the new gang loaded the critic once on each rank under DeepSpeed, on rank 0 alone
    under FSDP2 (``rft_core.training.fsdp.weights_on_rank0``), as the first gang did."""
    pytest.importorskip("ray")
    from rft_core.config import RayConfig, WorkersConfig
    from rft_core.models.critic import load_critic
    from rft_core.stages.contracts import CriticUpdateInput, CriticValuesInput
    from rft_core.workers.base import Gang, ResidentWorker
    from rft_core.workers.critic import CriticWorker
    from rft_core.workers.pool import run_resident, stop_workers
    from schemas import read_manifest, read_shard

    root, r, a = update_inputs[:3]
    critic, values, _ = random_head_critic(tiny_model, r, root / prefix)
    staged = critic_chain(update_inputs, critic, values, cfg, f"{prefix}-s", RUNNER, iterations=3)
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # as RUNNER's ranks
    workers = WorkersConfig(pool=str(tmp_path), threads=1, critic_ranks=2,
                            ray=RayConfig(options={"critic": {"runtime_env": {"env_vars": env}}}))
    refs, model = [], critic
    try:
        for i in (1, 2, 3):
            if i == 3:  # a new gang: the held shards and AdamW state are gone with the old one
                stats = Gang.named(CriticWorker, workers.pool, 2).call(ResidentWorker.stats)
                stop_workers(workers.pool)
            model = run_resident(CriticUpdateInput(rollout=r, advantages=a, critic_values=values, model=model, critic=cfg,
                                                   out=str(root / f"{prefix}-r{i}")), workers)
            refs.append(model)
            if i == 1:
                loads = [s.get("model_loads", 0) for s in Gang.named(CriticWorker, workers.pool, 2).call(ResidentWorker.stats)]
                held = run_resident(CriticValuesInput(rollout=r, model=model, critic=cfg, out=str(root / f"{prefix}-v")),
                                    workers)
        renewed = Gang.named(CriticWorker, workers.pool, 2).call(ResidentWorker.stats)
    finally:
        stop_workers(workers.pool)
    once = [1, 0] if cfg.fsdp is not None else [1, 1]  # FSDP2: rank 0 alone reads the weights (weights_on_rank0)
    assert loads == once and [s.get("model_loads", 0) for s in stats] == [loads[0] + 1, loads[1]], (loads, stats)
    assert [s["version"] for s in stats] == [f"{refs[1].uri}@{refs[1].manifest_sha256}"] * 2
    for got, want in zip(refs, staged):
        assert read_shard(got.uri).to_pydict()["value_loss"] == read_shard(want.uri).to_pydict()["value_loss"]
        w_got, w_want = (load_critic(f"{ref.uri}/critic").state_dict() for ref in (got, want))
        assert all(torch.equal(w_got[k], w_want[k]) for k in w_want), max_diff(w_got, w_want)
    for before, after in zip(refs, refs[1:]):  # each update continued the one before
        assert read_manifest(after.uri)[0].inputs["critic"] == read_manifest(before.uri)[1]
    assert [s.get("model_loads", 0) for s in renewed] == once and not {s["pid"] for s in renewed} & {s["pid"] for s in stats}
    with one_thread():
        stored = run_stage(CriticValuesInput(rollout=r, model=staged[0], critic=cfg, out=str(root / f"{prefix}-v-stage")))
    got, want = read_shard(held.uri).to_pydict()["values"], read_shard(stored.uri).to_pydict()["values"]
    diff = max(abs(x - y) for g, w in zip(got, want) for x, y in zip(g, w))
    assert got == want, diff
    assert got != read_shard(values.uri).to_pydict()["values"]  # the trained critic's, not the start's
    return refs, staged
