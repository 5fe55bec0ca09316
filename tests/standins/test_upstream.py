"""The stand-ins of ``tests/standins`` against the upstream code they copy, read from the real
packages: DeepSpeed and torch as installed here (always run), vLLM and SGLang from the wheels
the open pins install today (``vllm>=0.10.2``, ``sglang>=0.5.3``), downloaded without their
dependencies by ``make test-upstream`` into ``.cache/upstream`` and read, never imported (they
do not import on a CPU machine without their CUDA builds). Without ``RFT_UPSTREAM`` the vLLM and
SGLang checks are skipped. A failing check means upstream changed what a stand-in models: update
the stand-in (and the project's code if the change matters to it), then this test."""
from __future__ import annotations

import ast
import inspect
import os
import re
import zipfile
from pathlib import Path

import pytest

from tests.standins import engine_model
from tests.standins import sglang as sglang_standin

# -- installed here: DeepSpeed and torch ---------------------------------------------------------


def test_deepspeed_zero3_export_lands_on_the_cpu_on_rank_0_only():
    """tests/standins/deepspeed.py copies ``_zero3_consolidated_16bit_state_dict``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    src = inspect.getsource(DeepSpeedEngine._zero3_consolidated_16bit_state_dict)
    assert "state_dict = OrderedDict() if dist.get_rank() == 0 else None" in src
    assert "state_dict[key] = param.detach().cpu()" in src and "buf.detach().cpu()" in src
    assert "param.ds_id in shared_params" in src  # a shared parameter stored once


def test_torch_cuda_ipc_handle_carries_the_device_index_as_its_7th_argument():
    """rft_core/weightsync/cuda_ipc.py rewrites argument 6 of torch's ``rebuild_cuda_tensor``."""
    from torch.multiprocessing import reductions

    from rft_core.weightsync.cuda_ipc import _DEVICE_ARG

    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[_DEVICE_ARG] == "storage_device"


# -- vLLM and SGLang wheels ---------------------------------------------------------------------------

UPSTREAM = os.environ.get("RFT_UPSTREAM")
needs_wheels = pytest.mark.skipif(not UPSTREAM, reason="RFT_UPSTREAM not set: run `make test-upstream`")


def _wheel(name: str) -> zipfile.ZipFile:
    wheels = sorted(Path(UPSTREAM).glob(f"{name}-*.whl"), key=lambda p: [int(x) if x.isdigit() else x for x in
                                                                           re.split(r"[.-]", p.name.split("-")[1])])
    assert wheels, f"no {name} wheel in {UPSTREAM}"
    return zipfile.ZipFile(wheels[-1])


def _source(name: str, path: str) -> str:
    return _wheel(name).read(path).decode()


def _function(source: str, qualname: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    *owners, fn = qualname.split(".")
    body = tree.body
    for owner in owners:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == fn)


def _stacked_from_literal(node) -> set[tuple]:
    return {tuple(ast.literal_eval(e)) for e in node.elts}


@needs_wheels
def test_vllm_fuses_and_maps_hf_names_as_the_standin_does():
    src = _source("vllm", "vllm/model_executor/models/qwen2.py")
    mapping = re.search(r"orig_to_new_stacked=(\{.*?\})", src, re.S).group(1)
    got = {(old, new, shard) for old, (new, shard) in ast.literal_eval(re.sub(r"#.*", "", mapping)).items()}
    assert got == set(engine_model.STACKED)
    vocab = _source("vllm", "vllm/model_executor/layers/vocab_parallel_embedding.py")
    assert f"DEFAULT_VOCAB_PADDING_SIZE = {engine_model.VOCAB_PADDING}" in vocab
    utils = _source("vllm", "vllm/model_executor/models/utils.py")
    assert 'f"There is no module or parameter named {prefix!r} "' in utils  # unknown names refused
    loader = _source("vllm", "vllm/model_executor/model_loader/weight_utils.py")
    assert 'f"Attempted to load weight ({loaded_weight.size()}) "' in loader


@needs_wheels
def test_vllm_executor_raises_at_the_first_failed_reply_and_reload_weights_keeps_its_signature():
    src = _source("vllm", "vllm/v1/executor/multiproc_executor.py")
    body = ast.get_source_segment(src, _function(src, "MultiprocExecutor.collective_rpc"))
    loop = body[body.index("for mq in response_mqs:"):]
    assert "raise RuntimeError(" in loop and "Worker failed with error" in loop  # raised inside the per-queue loop
    assert "enable_fault_tolerance" in loop  # only a fault-tolerant engine reads on past a failure
    runner = _source("vllm", "vllm/v1/worker/gpu_model_runner.py")
    args = [a.arg for a in _function(runner, "GPUModelRunner.reload_weights").args.args]
    assert args == ["self", "weights_iterator", "weights_path", "is_checkpoint_format"]
    worker = _source("vllm", "vllm/v1/worker/gpu_worker.py")
    assert {"sleep", "wake_up", "reload_weights"} <= {n.name for n in ast.walk(ast.parse(worker))
                                                      if isinstance(n, ast.FunctionDef)}


@needs_wheels
def test_sglang_session_flush_and_loading_are_as_the_standin_models():
    updater = _source("sglang", "sglang/srt/managers/scheduler_components/weight_updater.py")
    assert ('"update_weights_from_tensor must run between "\n                "begin_weight_update() and '
            'end_weight_update()"') in updater
    flush = re.search(r'"Weights were updated, but the cache was not flushed because "\s*"(.*?)"\s*"(.*?)"', updater, re.S)
    assert "Weights were updated, but the cache was not flushed because " + flush.group(1) + flush.group(2) == \
        sglang_standin.NOT_FLUSHED
    engine = _source("sglang", "sglang/srt/entrypoints/engine.py")
    methods = {n.name for n in ast.walk(ast.parse(engine)) if isinstance(n, ast.FunctionDef)}
    assert {"begin_weight_update", "end_weight_update", "update_weights_from_tensor", "flush_cache"} <= methods
    qwen2 = _source("sglang", "sglang/srt/models/qwen2.py")
    legacy = ast.get_source_segment(qwen2, _function(qwen2, "Qwen2ForCausalLM._legacy_load_weights"))
    mapping = ast.parse(legacy).body[0].body[0].value
    assert {(f".{shard_name}", f".{param}", sid) for param, shard_name, sid in _stacked_from_literal(mapping)} == \
        set(engine_model.STACKED)
    assert 'logger.warning(f"Parameter {name} not found in params_dict")' in legacy  # unknown names skipped
    patch = _source("sglang", "sglang/srt/utils/patch_torch.py")
    from rft_core.weightsync.cuda_ipc import _DEVICE_ARG

    assert f"_REDUCE_TENSOR_ARG_DEVICE_INDEX = {_DEVICE_ARG}" in patch
