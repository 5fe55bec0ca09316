"""LoRA through peft (only adapters train, merged == adapter logits, checkpoints round-trip,
merge CLI), sample packing (same log-probs and update as the padded path), progress lines."""
from __future__ import annotations

import json

import pytest
import torch

from rft_core.config import LoraConfig, UpdateConfig
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs, build_packed_batch, response_logprobs
from rft_core.models.lora import apply_lora, is_adapter_dir, load_adapter_policy, main as lora_main
from rft_core.progress import LogProgress
from rft_core.stages.contracts import hash_value
from rft_core.stages.update import load_trainable_policy
from rft_core.training.strategy import SingleProcess, make_optimizer
from rft_core.training.update import UpdateData, ppo_update
from tests.update_settings import update_settings

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 500, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    old = [[-6.0] * len(r) for r in responses]
    adv = [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(responses)]
    return UpdateData(prompts, responses, old, adv)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_lora_update_changes_only_adapter_params(tiny_model):
    model = apply_lora(load_causal_lm(tiny_model, trainable=True), rank=4, alpha=8.0, dropout=0.0,
                       target_modules="all-linear", base_path=tiny_model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear found every attention and MLP projection of both layers, not the LM head
    adapted = {n.split(".")[-4] for n in trainable}
    assert adapted == LINEAR and len(trainable) == 2 * 2 * len(LINEAR)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    ppo_update(SingleProcess(model, opt, max_grad_norm=1.0), _data(), update_settings(micro_batch_size=3), pad_token_id=2)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert {n for n in changed if ".lora_B." in n}  # B starts at zero and moved


def test_merged_model_logits_equal_adapter_logits_and_checkpoint_round_trip(tiny_model, tmp_path):
    model = apply_lora(load_causal_lm(tiny_model, trainable=True), rank=4, alpha=8.0, dropout=0.0,
                       target_modules="all-linear", base_path=tiny_model)
    opt = make_optimizer(model, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    ppo_update(SingleProcess(model, opt, max_grad_norm=1.0), _data(), update_settings(micro_batch_size=6), pad_token_id=2)
    model.eval()
    ids = [5, 17, 99, 3, 250, 11, 7]
    want = _logits(model, ids)
    base = _logits(load_causal_lm(tiny_model), ids)
    assert (want - base).abs().max() > 1e-3  # the adapter does something
    model.save_pretrained(tmp_path / "adapter")
    assert is_adapter_dir(tmp_path / "adapter") and not (tmp_path / "adapter" / "model.safetensors").exists()
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == tiny_model and cfg["r"] == 4
    unmerged = load_adapter_policy(tmp_path / "adapter")
    torch.testing.assert_close(_logits(unmerged, ids), want, atol=0, rtol=0)
    merged = load_causal_lm(str(tmp_path / "adapter"))  # how rollout / log-prob stages load it
    assert not hasattr(merged, "peft_config")
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=0)
    # export through the CLI: a plain HF folder
    from rft_core.models.loading import load_tokenizer

    load_tokenizer(tiny_model).save_pretrained(tmp_path / "adapter")
    assert lora_main(["merge", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").exists() and not is_adapter_dir(tmp_path / "merged")
    torch.testing.assert_close(_logits(load_causal_lm(str(tmp_path / "merged")), ids), want, atol=1e-5, rtol=0)


def test_an_adapter_checkpoint_lists_its_target_modules_in_one_order_in_every_process(tiny_model, tmp_path):
    """peft resolves ``all-linear`` to a set of module names and writes it as ``list(set)``, in an
    order that follows the process's string hashes (a resident trainer in a Ray actor and stage
    mode in the driver wrote two adapter_config.json files for one adapter); ``save_checkpoint``
    writes them sorted (``sorted_target_modules``), the model keeps its set, and peft reads the
    file back as the same set."""
    from rft_core.training.checkpoint import save_checkpoint
    from rft_core.models.loading import load_tokenizer

    model = apply_lora(load_causal_lm(tiny_model), rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear",
                       base_path=tiny_model)
    modules = model.peft_config["default"].target_modules
    assert isinstance(modules, set) and len(modules) == 14  # 2 layers x 7 projections, by full name
    save_checkpoint(model, load_tokenizer(tiny_model), None, tmp_path / "policy")
    written = json.loads((tmp_path / "policy" / "adapter_config.json").read_text())["target_modules"]
    assert written == sorted(modules) and model.peft_config["default"].target_modules is modules
    assert load_adapter_policy(tmp_path / "policy").peft_config["default"].target_modules == modules


def test_update_stage_continues_an_adapter_checkpoint(tiny_model, tmp_path):
    cfg = UpdateConfig(lora=LoraConfig(rank=4, alpha=8.0))
    model = load_trainable_policy(tiny_model, cfg, dtype="float32")
    model.save_pretrained(tmp_path / "ckpt")
    again = load_trainable_policy(str(tmp_path / "ckpt"), cfg, dtype="float32")
    assert {n for n, p in again.named_parameters() if p.requires_grad} == {n for n, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="LoRA rank 4 but update.lora.rank is 8"):
        load_trainable_policy(str(tmp_path / "ckpt"), UpdateConfig(lora=LoraConfig(rank=8)), dtype="float32")
    with pytest.raises(ValueError, match="update.lora is not set"):
        load_trainable_policy(str(tmp_path / "ckpt"), UpdateConfig(), dtype="float32")
    # new fields at their defaults leave the update's config hash of older runs unchanged
    assert "lora" not in hash_value(UpdateConfig()) and hash_value(cfg)["lora"]["rank"] == 4


def test_an_adapter_checkpoint_of_another_alpha_is_refused_by_name(tiny_model, tmp_path):
    """An update continuing a LoRA checkpoint (``policy.path`` an adapter folder) takes its alpha
    as ``update.lora`` says, or refuses it naming the file's value and the key (its rank: the test
    above), and refuses an rsLoRA adapter, which ``update.lora`` cannot express: the adapter keeps
    the scaling it was trained with, and a resident engine's copy applies ``update.lora``'s
    (``RolloutWorker._engine_adapters``)."""
    from tests.rft_core.engines.fakes import lora_adapter

    adapter = lora_adapter(tiny_model, tmp_path / "adapter", 0, rank=2)  # alpha 4.0
    model = load_trainable_policy(adapter, UpdateConfig(lora=LoraConfig(rank=2, alpha=4.0)), dtype="float32")
    assert model.peft_config["default"].r == 2 and model.peft_config["default"].lora_alpha == 4.0
    with pytest.raises(ValueError, match=r"has LoRA alpha 4.0 but update.lora.alpha is 8.0: set update.lora.alpha: 4.0"):
        load_trainable_policy(adapter, UpdateConfig(lora=LoraConfig(rank=2, alpha=8.0)), dtype="float32")
    config = tmp_path / "adapter" / "adapter_config.json"  # rsLoRA scales by alpha / sqrt(rank): not expressible
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora, rank_pattern or alpha_pattern, which update.lora cannot express"):
        load_trainable_policy(adapter, UpdateConfig(lora=LoraConfig(rank=2, alpha=4.0)), dtype="float32")


def test_an_adapter_checkpoint_on_other_modules_is_refused_by_name(tiny_model, tmp_path):
    """Continuing a LoRA checkpoint takes its target modules as update.lora selects them on its
    base (peft's matching; all-linear: every Linear but the LM head), however they are spelled,
    or refuses it at load naming the modules, instead of training other modules than the config (and its hash) says and failing
    only at a resident sync's plan check."""
    qv = UpdateConfig(lora=LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    every = UpdateConfig(lora=LoraConfig(rank=4, alpha=8.0))  # all-linear
    for name, cfg in (("qv", qv), ("all", every)):
        load_trainable_policy(tiny_model, cfg, dtype="float32").save_pretrained(tmp_path / name)
    assert load_trainable_policy(str(tmp_path / "qv"), qv, dtype="float32").peft_config["default"].r == 4
    assert load_trainable_policy(str(tmp_path / "all"), every, dtype="float32").peft_config["default"].r == 4
    with pytest.raises(ValueError, match=r"other modules than update.lora asks for: update.lora.target_modules "
                                         r"\(all-linear\) selects 10 module\(s\) the adapter leaves without LoRA "
                                         r"\(\['model.layers.0.mlp.down_proj', .*\]\); set"):
        load_trainable_policy(str(tmp_path / "qv"), every, dtype="float32")  # 2 layers x (k, o, gate, up, down)
    with pytest.raises(ValueError, match=r"target_modules \(\['q_proj', 'v_proj'\]\) leaves out 10 module\(s\) "
                                         r"the adapter adapts \(\['model.layers.0.mlp.down_proj', .*; set "
                                         r"update.lora.target_modules to the adapter's"):
        load_trainable_policy(str(tmp_path / "all"), qv, dtype="float32")
    # the same modules spelled otherwise: peft recorded all-linear as paths, the list names them by suffix
    spelled = UpdateConfig(lora=LoraConfig(rank=4, alpha=8.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    assert load_trainable_policy(str(tmp_path / "all"), spelled, dtype="float32").peft_config["default"].r == 4


def test_packed_batch_layout():
    b = build_packed_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]])
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 8, 3, 4, 9]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert b.logit_index.tolist() == [2, 3, 5, 6, 7]  # the position before each response token
    assert b.target_ids.tolist() == [1, 2, 3, 4, 9]
    assert b.action_mask.tolist() == [[True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="empty prompt"):
        build_packed_batch([[]], [[1]])


def test_packed_logprobs_equal_padded_logprobs(tiny_model):
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 5, 3, 7)]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 1, 7, 4, 2, 0, 5)]
    kw = dict(pad_token_id=2, micro_batch_size=4, temperature=0.7, with_entropy=True)
    lp_pad, ent_pad = batched_response_logprobs(model, prompts, responses, **kw)
    lp_pack, ent_pack = batched_response_logprobs(model, prompts, responses, packing=True, **kw)
    for a, b, ea, eb, r in zip(lp_pad, lp_pack, ent_pad, ent_pack, responses):
        assert len(b) == len(r)
        assert b == pytest.approx(a, abs=1e-5) and eb == pytest.approx(ea, abs=1e-5)
    # attention stays inside each sequence: a sequence packed behind another gets the log-probs
    # it gets alone
    with torch.no_grad():
        alone = response_logprobs(model, build_packed_batch([prompts[6]], [responses[6]]))[0][0]
        behind = response_logprobs(model, build_packed_batch([prompts[1], prompts[6]], [responses[1], responses[6]]))[0][1]
    torch.testing.assert_close(behind, alone, atol=1e-5, rtol=0)


def test_packed_update_equals_padded_update(tiny_model):
    """Old log-probs the model's own (ratio 1 at the first step: with _data's -6.0 the ratio is
    ~0.008 and every A = -1 sample sits in the clipped region with no gradient)."""
    raw = _data(n=8, seed=3)
    old = batched_response_logprobs(load_causal_lm(tiny_model), raw.prompts, raw.responses, pad_token_id=2)
    data = UpdateData(raw.prompts, raw.responses, old, raw.advantages)
    runs = []
    base = torch.cat([p.detach().flatten() for p in load_causal_lm(tiny_model).parameters()])
    for packing in (False, True):
        model = load_causal_lm(tiny_model, trainable=True)
        # plain SGD: the weights move by the gradients themselves (Adam's 1/sqrt(v) would turn the rounding of a
        # near-zero gradient into a sizeable part of lr), so the comparison below is of the gradients
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = ppo_update(SingleProcess(model, opt, max_grad_norm=1e9), data,
                           update_settings(micro_batch_size=3, train_batch_size=4, epochs=2, packing=packing), pad_token_id=2)
        runs.append((steps, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (s0, w0), (s1, w1) = runs
    assert len(s0) == len(s1) == 4 and (w0 - base).abs().max() > 1e-2  # four real steps
    for a, b in zip(s0, s1):
        assert b.policy_loss == pytest.approx(a.policy_loss, abs=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4) and a.grad_norm > 1e-2
    torch.testing.assert_close(w1, w0, atol=1e-5, rtol=0)


def test_progress_log_lines_are_throttled_and_end_at_completion():
    lines: list[str] = []
    p = LogProgress("rollout", unit="sequences", log_fn=lines.append, every_seconds=3600)
    for done in range(1, 11):
        p(done, 10)
    assert len(lines) == 2 and lines[0].startswith("rollout: 1/10 sequences (10%)")
    assert lines[1].startswith("rollout: 10/10 sequences (100%)")


def test_progress_bar_when_asked_and_log_lines_for_a_second_concurrent_one():
    from rft_core.progress import progress_reporter

    lines: list[str] = []
    with progress_reporter("outer", use_bar=True) as outer:
        outer(1, 2)
        with progress_reporter("inner", use_bar=True, log_fn=lines.append, every_seconds=0) as inner:
            inner(1, 2)  # rich allows one live display: the second reporter logs instead of failing
        outer(2, 2)
    assert lines == [lines[0]] and lines[0].startswith("inner: 1/2 (50%)")


def test_progress_lines_carry_eta_and_token_rate_and_a_heartbeat_fills_silent_stretches():
    import time

    from rft_core.progress import progress_reporter

    lines: list[str] = []
    p = LogProgress("rollout", unit="sequences", log_fn=lines.append, every_seconds=3600)
    p.t0 -= 20.0  # 20 s elapsed
    p(5, 10, 400)
    assert lines == ["rollout: 5/10 sequences (50%), 20.0s, ETA 20s, 20.0 tokens/s"]
    # a unit slower than every_seconds: the heartbeat repeats the state, never silent longer than that
    lines.clear()
    with progress_reporter("ppo_update", unit="micro-batches", log_fn=lines.append, every_seconds=0.2,
                           use_bar=False) as progress:
        time.sleep(0.5)  # nothing done yet: "started"
        progress(1, 4)
        time.sleep(0.5)
        progress(4, 4)
    assert lines[0].startswith("ppo_update: started, 0.2s")
    assert any(line.startswith("ppo_update: 1/4 micro-batches (25%)") and "ETA" in line for line in lines[1:-1])
    assert lines[-1].startswith("ppo_update: 4/4 micro-batches (100%)")
    assert len(lines) >= 4


def test_the_update_reports_each_micro_batch_of_each_step(tiny_model):
    model = load_causal_lm(tiny_model, trainable=True)
    calls: list[tuple[int, int]] = []
    strategy = SingleProcess(model, make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999)),
                             max_grad_norm=1.0)
    ppo_update(strategy, _data(n=6), update_settings(epochs=2, train_batch_size=4, micro_batch_size=3), pad_token_id=2,
               progress=lambda done, total, tokens=None: calls.append((done, total)))
    # 2 epochs x (a step of 4 samples: 2 micro-batches, a step of 2: 1) = 6 passes, reported from 0
    assert calls == [(i, 6) for i in range(7)]
