"""FSDP2 reads a model's weights on rank 0 alone (``rft_core.training.fsdp.weights_on_rank0``): the
other ranks build the same modules on the meta device and receive their shards from rank 0. On 2
ranks (spawned processes, gloo, one thread each), for a bfloat16 policy (float32 masters, tied
embedding and LM head; also with CPU offload), a float32 policy with new LoRA adapters, a LoRA
checkpoint continued with gradient checkpointing, a critic and the tiny Qwen2-VL (vision blocks,
mrope buffers): every rank's shards
gather to exactly the weights a full load gives (the masters exactly upcast), the rotary buffers
(in no state dict) are rank 0's, the tie holds, the sharded forward equals the full model's, and
rank 1 counted no model load and read no weight bytes while rank 0 did. A rank that built another
model is refused on every rank before any weight moves."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from rft_core.counters import counts
from rft_core.models.critic import load_critic
from rft_core.models.lora import apply_lora
from rft_core.models.loading import load_causal_lm
from rft_core.models.tiny_vl import TINY_VL_MODEL, ensure_tiny_vl_model
from rft_core.network import free_port
from rft_core.training.fsdp import FSDPStrategy, weights_on_rank0

WORLD = 2
IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 11]])


def _policy_bf16(folder: str):
    return load_causal_lm(folder, dtype="bfloat16", trainable=True)


def _policy_lora(folder: str):
    return apply_lora(load_causal_lm(folder, trainable=True), rank=4, alpha=8, dropout=0.0, target_modules="all-linear",
                      base_path=folder, seed=3)


def _policy_adapter(folder: str):
    """A LoRA checkpoint continued (``_save_adapter``'s), with gradient checkpointing, as
    ``rft_core.stages.update.load_trainable_policy`` loads it."""
    model = load_causal_lm(os.path.join(os.path.dirname(folder), "adapter"), trainable=True, merge_adapter=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _save_adapter(folder: str) -> None:
    model = _policy_lora(folder)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(n)))
    model.save_pretrained(os.path.join(os.path.dirname(folder), "adapter"))


def _policy_vl(folder: str):
    """The tiny Qwen2-VL (``tiny-qwen2-vl``): vision blocks and decoder layers, mrope buffers."""
    return load_causal_lm(TINY_VL_MODEL, dtype="bfloat16", trainable=True)


def _critic(folder: str):
    model = load_critic(folder, trainable=True)
    with torch.no_grad():  # a fresh head is zero: give it values that show where they came from
        model.score.weight.copy_(torch.linspace(-1, 1, model.score.weight.numel()).view_as(model.score.weight))
    return model


# name -> (what every rank loads, FSDP2's CPU offload)
CASES = {"policy-bf16": (_policy_bf16, False), "policy-bf16-offload": (_policy_bf16, True),
         "policy-lora": (_policy_lora, False), "policy-adapter": (_policy_adapter, False), "critic": (_critic, False),
         "policy-vl": (_policy_vl, False)}


def _inner(model):
    """A peft model's base, or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _case(name: str, folder: str, rank: int) -> dict:
    build, offload = CASES[name]
    before = dict(counts())
    with weights_on_rank0(True):
        model = build(folder)
    read = {k: counts().get(k, 0) - before.get(k, 0) for k in ("model_loads", "bytes_read")}
    meta_before = any(p.is_meta for p in model.parameters())
    strategy = FSDPStrategy(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                            cpu_offload=offload)
    reference = build(folder)  # what every rank would have loaded itself
    want = {n: p.detach().float() for n, p in reference.named_parameters()}
    got, diffs = {}, []
    with torch.no_grad():
        for n, p in strategy.model.named_parameters():
            got[n] = p.full_tensor()  # a collective: every rank gathers
            if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n]):
                diffs.append(n)
        buffers = {n: b for n, b in strategy.model.named_buffers()}
        buffer_diffs = [n for n, b in reference.named_buffers() if not torch.equal(buffers[n], b)]
        inner = _inner(strategy.model)
        tied, ref_tied = (None if not hasattr(m, "lm_head") else m.get_output_embeddings().weight is
                          m.get_input_embeddings().weight for m in (inner, _inner(reference)))
        logits = strategy.model(input_ids=IDS).logits.float()
        # bfloat16 compute from the float32 masters: the reference computes on its bfloat16 weights
        ref_logits = reference(input_ids=IDS).logits.float()
    return {"read": read, "meta_before": meta_before, "diffs": diffs, "buffer_diffs": buffer_diffs,
            "buffers": sorted(buffers), "tied": tied, "ref_tied": ref_tied, "masters": sorted({str(t.dtype) for t in got.values()}),
            "logits_diff": float((logits - ref_logits).abs().max()), "logits_max": float(ref_logits.abs().max())}


def _mismatch(folder: str, rank: int) -> str:
    """Rank 1 builds the float32 model where rank 0 built the bfloat16 one."""
    try:
        FSDPStrategy(load_causal_lm(folder, dtype="bfloat16" if rank == 0 else "float32", trainable=True),
                     lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    except ValueError as exc:
        return str(exc)
    return ""


def _save_untied(folder: str) -> None:
    """A checkpoint holding an LM head other than its embedding under a config that ties them:
    transformers 5.24 loads it untied on rank 0 (``modeling_utils.py``: "both are present in the
    checkpoints with different values, so we will NOT tie them"); a model built from the config ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    cfg.tie_word_embeddings = False
    torch.manual_seed(5)
    out = os.path.join(os.path.dirname(folder), "untied")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "tie_word_embeddings": True}, f)


def _untied(folder: str, rank: int) -> str:
    try:
        with weights_on_rank0(True):
            model = load_causal_lm(os.path.join(os.path.dirname(folder), "untied"), trainable=True)
        FSDPStrategy(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    except ValueError as exc:
        return str(exc)
    return ""


def _rank(rank: int, folder: str, port: int, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    results = {name: _case(name, folder, rank) for name in CASES}
    results["mismatch"] = _mismatch(folder, rank)
    results["untied"] = _untied(folder, rank)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("rank0-load"))
    folder = shutil.copytree(tiny_model, os.path.join(out, "model"))
    _save_adapter(folder)
    _save_untied(folder)
    ensure_tiny_vl_model()  # built once here, not by both ranks at once
    mp.start_processes(_rank, args=(folder, free_port(), out), nprocs=WORLD, start_method="spawn")
    results = []
    for r in range(WORLD):
        with open(os.path.join(out, f"{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank0_alone_reads_the_weights_and_every_rank_gets_its_shards_of_them(ranks, case):
    zero, one = ranks[0][case], ranks[1][case]
    assert zero["read"]["model_loads"] >= 1 and zero["read"]["bytes_read"] > 0
    assert one["read"] == {"model_loads": 0, "bytes_read": 0} and one["meta_before"] and not zero["meta_before"]
    for r in (zero, one):
        assert r["diffs"] == [] and r["buffer_diffs"] == []  # bit for bit, every parameter and buffer
        assert r["masters"] == ["torch.float32"]  # a bfloat16 policy's masters: its weights exactly upcast
    if case != "critic":  # the rotary embedding's inv_freq: in no state dict, rank 0's on every rank (above)
        assert any(b.endswith("rotary_emb.inv_freq") for b in zero["buffers"]), zero["buffers"]
        assert zero["tied"] is one["tied"] is zero["ref_tied"] is True  # both tiny models tie their head
    # the sharded forward computes what the full model computes (bfloat16: on the same rounded weights)
    assert zero["logits_max"] > 1e-3
    assert zero["logits_diff"] <= 1e-5 and one["logits_diff"] <= 1e-5, (zero["logits_diff"], one["logits_diff"])


def test_a_rank_that_built_another_model_is_refused_on_every_rank(ranks):
    for r in ranks:
        assert "rank 1 built another model than rank 0" in r["mismatch"], r["mismatch"]
        assert "torch.float32" in r["mismatch"] and "torch.bfloat16" in r["mismatch"]


def test_a_checkpoint_loaded_untied_against_its_config_is_refused_saying_so(ranks):
    for r in ranks:
        assert "rank 1 built another model than rank 0" in r["untied"], r["untied"]
        assert "set tie_word_embeddings: false in its config.json" in r["untied"], r["untied"]
