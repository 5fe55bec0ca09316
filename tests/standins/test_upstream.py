"""The stand-ins of ``tests/standins`` against the upstream code they copy, read from the real
packages: DeepSpeed and torch as installed here (always run), vLLM and SGLang from the wheels of
the releases constraints-gpu.txt pins (what ``make install-gpu`` installs), downloaded without
their dependencies by ``make test-upstream`` into ``.cache/upstream`` and read, never imported
(they do not import on a CPU machine without their CUDA builds). Without ``RFT_UPSTREAM`` the vLLM
and SGLang checks are skipped; with it, a missing wheel of the pinned release fails.

Beyond the behaviour each stand-in models (fused names, the executor's first failure, the
session, the flush, the refusals of ``tests/standins/test_standins.py``), three places where a
stand-in could silently drift from upstream are read: SGLang's newer weight loader
(``_load_weights_v2``, behind ``SGLANG_ENABLE_WEIGHT_LOADER_V2``), that SGLang's
``update_weights_from_disk`` stays outside the weight-update session, and vLLM's rule that a
worker extension may not shadow an attribute of the worker class (checked against the project's
``WeightReloadExtension``). A failing check means upstream changed what a stand-in models: update
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
from tests.standins import vllm as vllm_standin

ROOT = Path(__file__).resolve().parents[2]

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


# -- vLLM and SGLang wheels of the pinned releases -------------------------------------------------

UPSTREAM = os.environ.get("RFT_UPSTREAM")
needs_wheels = pytest.mark.skipif(not UPSTREAM, reason="RFT_UPSTREAM not set: run `make test-upstream`")


def pinned(name: str) -> str:
    """The version constraints-gpu.txt pins ``name`` to (``name==version``)."""
    for line in (ROOT / "constraints-gpu.txt").read_text().splitlines():
        m = re.fullmatch(rf"\s*{re.escape(name)}\s*==\s*([^\s#]+)\s*(#.*)?", line)
        if m:
            return m.group(1)
    raise AssertionError(f"constraints-gpu.txt pins no {name}==<version>")


def test_the_gpu_constraints_pin_the_releases_the_standins_copy():
    """The stand-ins name the releases they copy; those are the ones constraints-gpu.txt installs."""
    assert f"vLLM {pinned('vllm')}" in vllm_standin.__doc__
    assert f"SGLang {pinned('sglang')}" in sglang_standin.__doc__


def _wheel(name: str) -> zipfile.ZipFile:
    version = pinned(name)
    wheels = sorted(Path(UPSTREAM).glob(f"{name}-{version}-*.whl"))
    assert wheels, f"no {name} {version} wheel (constraints-gpu.txt) in {UPSTREAM}: run `make test-upstream`"
    return zipfile.ZipFile(wheels[0])


def _source(name: str, path: str) -> str:
    return _wheel(name).read(path).decode()


def _class(source: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)


def _function(source: str, qualname: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    *owners, fn = qualname.split(".")
    body = tree.body
    for owner in owners:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == fn)


def _fields(cls: ast.ClassDef) -> set[str]:
    """The annotated class-level names (dataclass / msgspec fields) of ``cls``."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _names(cls: ast.ClassDef) -> set[str]:
    """Every name ``cls`` defines at class level: methods, fields, assignments."""
    names = _fields(cls) | {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names | {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def _params(fn: ast.FunctionDef) -> set[str]:
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}


def _literal(source: str, name: str) -> tuple:
    """The values of ``name = Literal[...]`` in ``source``."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign) and
                any(isinstance(t, ast.Name) and t.id == name for t in n.targets))
    sub = node.value.slice
    return tuple(ast.literal_eval(e) for e in (sub.elts if isinstance(sub, ast.Tuple) else [sub]))


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
def test_vllm_executor_raises_at_the_first_failed_reply_waits_without_limit_and_reload_weights_keeps_its_signature():
    src = _source("vllm", "vllm/v1/executor/multiproc_executor.py")
    body = ast.get_source_segment(src, _function(src, "MultiprocExecutor.collective_rpc"))
    loop = body[body.index("for mq in response_mqs:"):]
    assert "raise RuntimeError(" in loop and "Worker failed with error" in loop  # raised inside the per-queue loop
    assert "enable_fault_tolerance" in loop  # only a fault-tolerant engine reads on past a failure
    assert "deadline = None if timeout is None" in body  # no timeout: it waits forever
    assert 'raise TimeoutError(f"RPC call to {method} timed out.")' in body
    monitor = ast.get_source_segment(src, _function(src, "MultiprocExecutor.start_worker_monitor"))
    assert "_self.is_failed = True" in monitor and "_self.shutdown()" in monitor  # a dead worker fails the executor
    dead = _source("vllm", "vllm/v1/engine/exceptions.py")
    assert vllm_standin.EngineDeadError().args[0] in dead
    runner = _source("vllm", "vllm/v1/worker/gpu_model_runner.py")
    args = [a.arg for a in _function(runner, "GPUModelRunner.reload_weights").args.args]
    assert args == ["self", "weights_iterator", "weights_path", "is_checkpoint_format"]
    worker = _source("vllm", "vllm/v1/worker/gpu_worker.py")
    assert {"sleep", "wake_up", "reload_weights"} <= {n.name for n in ast.walk(ast.parse(worker))
                                                      if isinstance(n, ast.FunctionDef)}
    cumem = _source("vllm", "vllm/device_allocator/cumem.py")
    assert "unmap_and_release" in ast.get_source_segment(cumem, _function(cumem, "CuMemAllocator.sleep"))


@needs_wheels
def test_vllm_engine_arguments_and_sampling_fields_the_standin_takes_are_upstream_ones():
    llm = _source("vllm", "vllm/entrypoints/llm.py")
    explicit = _params(_function(llm, "LLM.__init__"))
    standin = {p for p in inspect.signature(vllm_standin.LLM.__init__).parameters if p not in ("self", "kwargs")}
    assert standin <= explicit
    args = _source("vllm", "vllm/engine/arg_utils.py")
    assert "@dataclass\nclass EngineArgs:" in args  # an unknown keyword is a TypeError
    assert set(vllm_standin.ENGINE_ARGS) <= _fields(_class(args, "EngineArgs"))
    model = _source("vllm", "vllm/config/model.py")
    assert _literal(model, "LogprobsMode") == vllm_standin.LOGPROBS_MODES
    assert set(_literal(model, "ModelDType")) == {"auto", *vllm_standin.DTYPES}
    assert _literal(_source("vllm", "vllm/config/lora.py"), "MaxLoRARanks") == vllm_standin.MAX_LORA_RANKS
    sampling = _source("vllm", "vllm/sampling_params.py")
    params = _class(sampling, "SamplingParams")
    assert "msgspec.Struct" in ast.get_source_segment(sampling, params).split(":", 1)[0]  # unknown fields refused
    assert set(vllm_standin.SAMPLING_FIELDS) <= _fields(params)
    for message in ("top_p must be in (0, 1], got", "temperature must be in [0, 2], got",
                    "n must be 1 when using greedy sampling, got"):
        assert message in sampling


@needs_wheels
def test_vllm_generate_pairs_prompts_with_params_and_refuses_lora_it_was_not_built_for():
    offline = _source("vllm", "vllm/entrypoints/common/offline.py")
    assert 'f"The lengths of prompts ({num_requests}) "\n                    f"and params ({len(params)}) must be the same."' \
        in offline
    assert 'f"and lora_request ({len(lora_request)}) must be the same."' in offline
    llm = _source("vllm", "vllm/entrypoints/llm.py")
    assert {"prompts", "sampling_params", "use_tqdm", "lora_request", "priority"} <= \
        _params(_function(llm, "LLM.generate"))
    processor = _source("vllm", "vllm/v1/engine/input_processor.py")
    assert 'f"Got lora_request {lora_request} but LoRA is not enabled!"' in processor
    request = _source("vllm", "vllm/lora/request.py")
    assert 'f"id must be > 0, got {self.lora_int_id}"' in request
    exceptions = _source("vllm", "vllm/exceptions.py")
    assert 'f"Loading lora {lora_name} failed: No adapter found for {lora_path}"' in exceptions
    assert '"LoRA rank {max_rank} is greater than max_lora_rank"' in \
        _source("vllm", "vllm/lora/peft_helper.py").replace('f"LoRA rank', '"LoRA rank')
    core = _source("vllm", "vllm/v1/engine/core.py")
    assert "EngineCore encountered a fatal error." in core and "engine_core._send_engine_dead()" in core


@needs_wheels
def test_vllm_worker_extension_may_not_shadow_a_worker_attribute_and_the_projects_does_not():
    """Blind spot: ``WorkerWrapperBase.init_worker`` refuses an extension attribute the worker class
    has; the project's ``WeightReloadExtension`` is checked against the real worker's names."""
    from rft_core.engines.vllm import WeightReloadExtension

    base = _source("vllm", "vllm/v1/worker/worker_base.py")
    init = ast.get_source_segment(base, _function(base, "WorkerWrapperBase.init_worker"))
    assert "for attr in dir(worker_extension_cls):" in init and 'if attr.startswith("__"):' in init
    assert "assert not hasattr(worker_class, attr)" in init and "already has an attribute" in init
    worker = _names(_class(_source("vllm", "vllm/v1/worker/gpu_worker.py"), "Worker")) | _names(_class(base, "WorkerBase"))
    ours = {a for a in dir(WeightReloadExtension) if not a.startswith("__")}
    assert ours and not ours & worker, sorted(ours & worker)
    assert "already has an attribute {attr}, which conflicts" in inspect.getsource(vllm_standin.worker_class)


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


@needs_wheels
def test_sglang_newer_loader_raises_on_unknown_names_when_switched_on():
    """Blind spot: ``load_weights`` takes ``_load_weights_v2`` when ``SGLANG_ENABLE_WEIGHT_LOADER_V2``
    is set (off by default); its ``AutoWeightsLoader`` raises on a name the model does not have,
    ignoring only ``.bias`` and ``.kv_scale``, as the stand-in's ``sglang_v2`` flavour does."""
    environ = _source("sglang", "sglang/srt/environ.py")
    assert re.search(r"SGLANG_ENABLE_WEIGHT_LOADER_V2 = EnvBool\(False\)", environ)
    qwen2 = _source("sglang", "sglang/srt/models/qwen2.py")
    dispatch = ast.get_source_segment(qwen2, _function(qwen2, "Qwen2ForCausalLM.load_weights"))
    assert "envs.SGLANG_ENABLE_WEIGHT_LOADER_V2.get()" in dispatch and "self._load_weights_v2(weights)" in dispatch
    v2 = ast.get_source_segment(qwen2, _function(qwen2, "Qwen2ForCausalLM._load_weights_v2"))
    assert 'ignore_unexpected_suffixes=[".bias", ".kv_scale"]' in v2 and "return loaded" in v2
    utils = _source("sglang", "sglang/srt/models/utils.py")
    loader = ast.get_source_segment(utils, _class(utils, "AutoWeightsLoader"))
    assert 'f"No module or parameter named {prefix!r} in {self.module._get_name()}."' in loader
    assert "No module or parameter named" in inspect.getsource(engine_model.EngineModel.load_weights)


@needs_wheels
def test_sglang_update_from_disk_stays_outside_the_session():
    """Blind spot: only the in-memory updates need the session; ``update_weights_from_disk`` (the
    engine's reload of a checkpoint) checks none, as the stand-in models."""
    updater = _source("sglang", "sglang/srt/managers/scheduler_components/weight_updater.py")
    disk = ast.get_source_segment(updater, _function(updater, "SchedulerWeightUpdaterManager.update_weights_from_disk"))
    tensor = ast.get_source_segment(updater, _function(updater,
                                                       "SchedulerWeightUpdaterManager.update_weights_from_tensor"))
    assert "self._session is None" in tensor and "_session" not in disk


@needs_wheels
def test_sglang_arguments_sampling_seeds_and_lora_answers_are_upstream_ones():
    engine = _source("sglang", "sglang/srt/entrypoints/engine.py")
    assert "server_args = self.server_args_class(**kwargs)" in engine
    server = _source("sglang", "sglang/srt/server_args.py")
    assert "ServerArgs = msgspec.defstruct(" in server  # an unknown keyword is a TypeError
    fields: set[str] = set()
    wheel = _wheel("sglang")
    for path in wheel.namelist():
        if path.startswith("sglang/srt/arg_groups/fields/") and path.endswith(".py"):
            for cls in ast.walk(ast.parse(wheel.read(path).decode())):
                if isinstance(cls, ast.ClassDef) and "_NS_PATH" in _names(cls):
                    fields |= _fields(cls)
    assert set(sglang_standin.SERVER_ARGS) <= fields, sorted(set(sglang_standin.SERVER_ARGS) - fields)
    generate = {p for p in inspect.signature(sglang_standin.Engine.generate).parameters if p != "self"}
    assert generate <= _params(_function(engine, "Engine.generate"))
    sampling = _source("sglang", "sglang/srt/sampling/sampling_params.py")
    assert set(sglang_standin.SAMPLING_FIELDS) <= _fields(_class(sampling, "SamplingParams"))
    batch = _source("sglang", "sglang/srt/sampling/sampling_batch_info.py")
    assert re.search(r"r\.sampling_params\.sampling_seed\s*if r\.sampling_params\.sampling_seed is not None\s*"
                     rf"else {sglang_standin.UNSEEDED}", batch)
    assert "if enable_deterministic" in batch  # without deterministic inference no seed is used
    control = _source("sglang", "sglang/srt/managers/tokenizer_control_mixin.py")
    assert f'"{sglang_standin.LORA_DISABLED}"' in control
    manager = _source("sglang", "sglang/srt/lora/lora_manager.py")
    assert "because it is already loaded" in manager and "is incompatible with the current" in manager
    registry = _source("sglang", "sglang/srt/lora/lora_registry.py")
    assert 'f"The following requested LoRA adapters are not loaded: {name}\\n"' in registry
    tokenizer = _source("sglang", "sglang/srt/managers/tokenizer_manager.py")
    assert "was requested, but LoRA is not enabled. " in tokenizer
