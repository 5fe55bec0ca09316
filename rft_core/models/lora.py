"""LoRA policies through peft: adapters on the base model, adapter checkpoints, merge for export.

A LoRA policy checkpoint (the ``policy/`` folder of a ppo_update stage) is a peft adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``) plus the tokenizer and the optimizer
state; its ``base_model_name_or_path`` is the configured base path (an alias such as
``smollm2-135m-instruct``, a folder or a hub id), resolved on load with ``resolve_model_path``.
The adapted weight is W + (alpha / rank) * B A (Hu et al. 2021, arXiv:2106.09685, eq. 3); B
starts at zero, so a fresh adapter leaves the model's outputs unchanged.

Export a merged, plain HF model (what vLLM or any HF tool loads)::

    python -m rft_core.models.lora merge runs/…/iter=000004/ppo_update-policy/policy exported/
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from rft_core.models.hub import ModelLoadError, attn_implementation, set_trainable
from rft_core.models.pretrained import building_shell, load_pretrained, load_tokenizer, resolve_model_path

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    """True when ``path`` is a local folder holding a peft adapter."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / ADAPTER_CONFIG).exists()


def adapter_base_path(adapter_dir: str | Path) -> str:
    """The base model path recorded in an adapter folder.

    Raises:
        ValueError: the adapter config names no base model.
    """
    cfg = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_dir}/{ADAPTER_CONFIG} names no base_model_name_or_path")
    return base


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (a LoRA policy). A process that never imported
    peft holds none, so peft (~0.4 s to import) is not imported to ask."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


@contextlib.contextmanager
def sorted_target_modules(model) -> Iterator[None]:
    """Within it, the peft configs of ``model`` (a ``PeftModel``, or an object whose ``model`` is
    one: a saver of gathered weights) hold their ``target_modules`` as a sorted list instead of
    a set, so that ``save_pretrained`` writes the same ``adapter_config.json`` in every process:
    peft writes a set as ``list(value)`` (``PeftConfigMixin.save_pretrained``,
    peft/config.py 0.21.2), whose order follows the process's string hashes (``PYTHONHASHSEED``),
    and ``all-linear`` is resolved to a set of module names; the same adapter saved in a Ray
    actor and in the driver got two checksums. peft reads a list back as the same set."""
    configs = getattr(model, "peft_config", None) or getattr(getattr(model, "model", None), "peft_config", None) or {}
    kept = {name: c.target_modules for name, c in configs.items() if isinstance(getattr(c, "target_modules", None), set)}
    for name, modules in kept.items():
        configs[name].target_modules = sorted(modules)
    try:
        yield
    finally:
        for name, modules in kept.items():
            configs[name].target_modules = modules


def keeps_adapters(dtype: str) -> bool:
    """Whether an inference copy of a LoRA policy in ``dtype`` keeps the float32 adapters on top
    of its base weights instead of merging them: below float32, where W + s·BA rounded to the
    base's dtype loses an update smaller than half a step of it and the copy would compute other
    log-probs than the trainer (docs/scale.md, "LoRA in bfloat16"). In float32 the merge equals
    the trainer's computation up to rounding, and a merged copy decodes faster. The one rule of
    ``rft_core.models.loading.load_causal_lm`` (stage mode's copies) and of the resident rollout
    worker (``rft_core.workers.rollout``: its syncs then carry the adapters only)."""
    return dtype != "float32"


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float, target_modules, base_path: str,
               seed: int | None = None):
    """Wrap ``model`` in a peft LoRA model whose adapters are the only trainable parameters.

    Args:
        target_modules: module names, or ``"all-linear"``: every ``nn.Linear`` except the output
            layer (peft's own detection, i.e. q/k/v/o and the MLP projections of a Llama).
        base_path: recorded in the adapter config as ``base_model_name_or_path`` (keep the
            configured path or alias, not a machine-local cache path).
        seed: peft draws the A matrices (Kaiming-uniform; B is 0) from torch's global generator:
            with a seed they are drawn with it seeded (the generator restored afterwards), so the
            first adapter does not depend on what ran before in the process; None: as it stands.
    Returns:
        A ``peft.PeftModel`` (adapters in float32 even on a bfloat16 base).
    """
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none",
                     task_type="CAUSAL_LM")
    device = next(model.parameters()).device
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
            for d in cuda:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
        peft_model = get_peft_model(model, cfg)
    peft_model.peft_config["default"].base_model_name_or_path = base_path
    return peft_model


def adapted_modules_differ(model, target_modules) -> str | None:
    """Why the peft LoRA ``model`` (a loaded adapter checkpoint) does not adapt the modules that
    ``target_modules`` (``update.lora.target_modules``) selects on its base, or None when it does:
    the modules it adapts against those peft would adapt on the same base, by peft's own matching
    (``check_target_module_exists`` for a list: a name equal to an entry or ending in ``.entry``;
    for ``"all-linear"`` every ``nn.Linear`` and ``Conv1D`` but the output layer, as
    ``_maybe_include_all_linear_layers``; peft/tuners/tuners_utils.py 0.21.2), read from the
    loaded model without building another: an adapter whose config spells the same modules
    otherwise (peft records all-linear as the paths it found) is not refused. A sentence naming
    the modules that differ."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists  # the caller holds a peft model
    from transformers.pytorch_utils import Conv1D

    base = model.get_base_model()  # names as peft matches them
    adapted = {name for name, m in base.named_modules() if isinstance(m, BaseTunerLayer)}
    inside = tuple(f"{name}." for name in adapted)
    layers = {name: (m.get_base_layer() if name in adapted else m) for name, m in base.named_modules()
              if name and not name.startswith(inside)}
    output = base.get_output_embeddings()
    output = output.get_base_layer() if isinstance(output, BaseTunerLayer) else output
    if target_modules == "all-linear":
        wanted = {name for name, m in layers.items() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not output}
    else:
        selects = LoraConfig(target_modules=list(target_modules))
        wanted = {name for name in layers if check_target_module_exists(selects, name)}
    missing, extra = sorted(wanted - adapted), sorted(adapted - wanted)
    if not missing and not extra:
        return None
    said = ([f"selects {len(missing)} module(s) the adapter leaves without LoRA ({missing[:3]})"] if missing else []) + (
        [f"leaves out {len(extra)} module(s) the adapter adapts ({extra[:3]})"] if extra else [])
    return f"update.lora.target_modules ({target_modules}) {' and '.join(said)}"


def adapter_shell(base_path: str, *, rank: int, alpha: float, dropout: float, target_modules):
    """A peft LoRA model of ``base_path``'s architecture on the meta device (``from_config`` under
    ``torch.device("meta")``: no weights read, no memory; its adapters float32, as a trainer's):
    the names, shapes and adapter config of a LoRA policy's adapters without its weights. What a
    receiver that holds no HF copy of the policy (a resident vLLM or SGLang engine) lands a sync of
    the adapters against and writes them back out with (``save_adapter``).

    Raises:
        OSError, ValueError: transformers cannot read the config of ``base_path``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(base_path))
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return apply_lora(base, rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules, base_path=base_path)


def save_adapter(shell, adapters: dict[str, torch.Tensor], out_dir: str | Path) -> str:
    """Write ``adapters`` (the peft model ``shell``'s adapter tensors under its state-dict names,
    e.g. landed by a sync: ``rft_core.weightsync.trained.adapter_tensors``) as a peft adapter
    folder, as a checkpoint's (``adapter_config.json`` with sorted target modules,
    ``adapter_model.safetensors``; peft's own ``save_pretrained(state_dict=...)``, which drops
    the adapter name from the keys): what vLLM's ``LoRARequest`` and SGLang's
    ``load_lora_adapter`` load. Returns ``out_dir`` as a string."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with sorted_target_modules(shell):  # no embedding layer saved: the shell's base holds no weights
        shell.save_pretrained(out, state_dict=adapters, save_embedding_layers=False)
    return str(out)


def merge_state(model, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain transformers model holding ``state`` (the state dict of the peft LoRA ``model``: its
    base and adapter tensors under their peft names, e.g. gathered from the ranks of a sharded
    trainer, whose ``model`` holds shards only) with the adapters folded in by peft's own
    ``merge_and_unload(safe_merge=True)``: a twin of ``model``'s base class built on the meta
    device from copies of its HF config and ``LoraConfig``, given ``state``'s tensors
    (``load_state_dict(assign=True)``). The safe merge adds into a copy of each adapted weight, so
    ``state``'s tensors are left as they are (on one rank they can be the trainer's own shards);
    the sum is peft's plain merge's (``orig_weight += delta``), what
    ``load_adapter_policy(merge=True)`` computes from a checkpoint of those tensors, bit for bit in
    float32 on one device. Non-persistent buffers (rotary frequencies) stay on the meta device:
    a source of weights, not a model to run.

    Raises:
        RuntimeError: ``state`` lacks a tensor of the model or has one it does not
            (``load_state_dict``, strict).
        ValueError: a merged weight is not finite (peft's safe merge).
    """
    from peft import get_peft_model

    base = model.get_base_model()
    with torch.device("meta"):
        twin = get_peft_model(type(base)._from_config(copy.deepcopy(base.config)),
                              copy.deepcopy(model.peft_config["default"]))
    twin.load_state_dict(state, assign=True)
    with torch.no_grad():
        return twin.merge_and_unload(safe_merge=True)


def load_adapter_policy(adapter_dir: str | Path, *, dtype: str = "float32", trainable: bool = False,
                        merge: bool = False):
    """Load the base model of ``adapter_dir`` with the adapter on top.

    Args:
        trainable: the adapter's parameters require grad (for the next update); the base stays frozen.
        merge: fold the adapter into the base weights and return a plain transformers model
            (inference: rollout, log-prob stages, export).
    Raises:
        rft_core.models.loading.ModelLoadError: the base or the adapter cannot be loaded.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = adapter_base_path(adapter_dir)
    base = load_pretrained(AutoModelForCausalLM, base_path, dtype=dtype, trainable=False, what="LoRA base model",
                           model_kwargs={"attn_implementation": attn_implementation(dtype)})
    try:
        # on a meta base (meta_shell) peft loads the adapters with assign=True (they stay on meta with the base),
        # where a copy into meta tensors would be a no-op torch warns of once per tensor
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable and not merge,
                                          low_cpu_mem_usage=building_shell())
    except Exception as exc:
        raise ModelLoadError(f"cannot load the LoRA adapter {adapter_dir} on {base_path!r}: {exc}") from exc
    if merge:
        model = model.merge_and_unload()
        model.requires_grad_(trainable)
    return set_trainable(model, trainable)


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> str:
    """Write the merged model (base + adapter folded in) and the tokenizer as a plain HF folder.

    Returns:
        ``out_dir`` as a string.
    """
    model = load_adapter_policy(adapter_dir, dtype=dtype, merge=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_tokenizer(str(adapter_dir)).save_pretrained(out)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m rft_core.models.lora merge ADAPTER_DIR OUT_DIR [--dtype bfloat16]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rft_core.models.lora", description="LoRA adapter tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="fold an adapter into its base model and save a plain HF folder")
    m.add_argument("adapter_dir")
    m.add_argument("out_dir")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ns = p.parse_args(argv)
    print(merge_adapter(ns.adapter_dir, ns.out_dir, dtype=ns.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
