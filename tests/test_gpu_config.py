"""configs/grpo_qwen7b_vllm.yaml, the 8-GPU recipe of docs/gpu.md ("From zero to a 7B run"),
stays valid: it loads through the config loader (every key exists, every rule passes; no model is
loaded) with the settings the page describes, and the Ray options its resident workers get on an
8-GPU node (``rft_core.workers.pool.actor_options``) add up to exactly the node's 8 GPUs."""
from __future__ import annotations

from pathlib import Path

from rft_core.config import load_config
from rft_core.workers.pool import actor_options

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_qwen7b_vllm.yaml"


def test_the_7b_recipe_loads_with_what_the_page_says():
    cfg = load_config(CONFIG)
    assert cfg.policy.path == "Qwen/Qwen2.5-7B-Instruct" and cfg.policy.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.tensor_parallel_size == 2
    assert cfg.update.deepspeed.zero_stage == 3
    assert cfg.update.deepspeed.torch_adam  # no DeepSpeed op compiled with nvcc on first use (pip-only environment)
    assert cfg.orchestration.workers == "resident" and cfg.orchestration.policy_ranks == 5
    assert cfg.checkpoint.every == 10 and cfg.resident_blockers() == []
    # the update is on-policy: one optimizer step over all samples of an iteration
    assert cfg.update.train_batch_size == cfg.data.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    for stage in ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update"):
        assert cfg.runner(stage).mode == "resident", stage
    assert cfg.recomputes_old_logprobs  # the actor pass runs, on the rollout worker (the memory note of the config)


def test_the_7b_workers_fill_one_8_gpu_node():
    cfg = load_config(CONFIG)
    workers = cfg.runner("ppo_update").workers
    roles = {"policy": workers.policy_ranks, "rollout": 1, "reference": 1}  # grpo: no critic; kl_coef > 0: a reference
    assert cfg.kl.kl_coef > 0 and not cfg.needs_critic
    assert workers.rollout_gpus == cfg.rollout.vllm.tensor_parallel_size == 2
    gpus = {role: actor_options(workers, role, cluster_gpus=8)["num_gpus"] for role in roles}
    assert gpus == {"policy": 1, "rollout": 2, "reference": 1}
    assert sum(gpus[r] * n for r, n in roles.items()) == 8


FSDP_VARIANT = ["update.deepspeed=null", "update.fsdp.reshard_after_forward=true"]  # docs/gpu.md, "FSDP2 instead"


def test_the_fsdp2_variant_of_the_7b_recipe_loads_and_fills_the_same_gpus():
    cfg = load_config(CONFIG, FSDP_VARIANT)
    assert cfg.update.deepspeed is None and cfg.update.fsdp.reshard_after_forward and not cfg.update.fsdp.cpu_offload
    assert cfg.orchestration.policy_ranks == 5 and cfg.resident_blockers() == []
    workers = cfg.runner("ppo_update").workers
    assert actor_options(workers, "policy", cluster_gpus=8)["num_gpus"] == 1


LORA_VARIANT = [*FSDP_VARIANT, "update.lora.rank=64", "update.lora.alpha=128", "update.lr=1.0e-5"]  # docs/gpu.md


def test_the_lora_variant_of_the_fsdp2_recipe_loads_and_syncs_adapters_into_vllm():
    """docs/gpu.md, "LoRA on FSDP2": the FSDP2 variant with update.lora loads under resident
    workers, the rollout worker is given the LoRA settings it builds its vLLM engine's adapter
    folders from, and vLLM's max_lora_rank holds the rank."""
    cfg = load_config(CONFIG, LORA_VARIANT)
    assert cfg.update.lora.rank == 64 and cfg.update.fsdp is not None and cfg.resident_blockers() == []
    assert cfg.policy.dtype == "bfloat16" and cfg.runner("rollout").workers.lora == cfg.update.lora
    assert cfg.rollout.vllm.max_lora_rank >= cfg.update.lora.rank
