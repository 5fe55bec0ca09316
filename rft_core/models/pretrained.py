"""Model paths and the loading primitives every model kind uses: resolve a configured path
(the default alias, the tiny VL alias, a local folder or a hub id), load a tokenizer, load any
transformers Auto class under the process-wide load lock."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

from rft_core.counters import count, count_bytes_read
from rft_core.models.hub import (
    DEFAULT_MODEL,
    LOAD_LOCK,
    ModelLoadError,
    ensure_default_model,
    prepare_tokenizer,
    quiet_transformers,
    set_trainable,
    torch_dtype,
)
from rft_core.models.tiny_vl import TINY_VL_MODEL, ensure_tiny_vl_model


def resolve_model_path(path: str) -> str:
    """Turn a configured model path into something ``from_pretrained`` can load.

    ``smollm2-135m-instruct`` (the default alias) -> the converted cache folder;
    ``tiny-qwen2-vl`` -> the cached tiny random Qwen2-VL (``rft_core.models.vl``); a local folder
    -> itself; anything else is passed on as a hub id (which needs network access).

    Raises:
        ModelLoadError: a path that looks local (absolute, ./, ~) but is not a folder with a
            config.json.
    """
    if path == DEFAULT_MODEL:
        return str(ensure_default_model())
    if path == TINY_VL_MODEL:  # the offline vision-language default, built once
        return str(ensure_tiny_vl_model())
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists() and not (p / "adapter_config.json").exists():
            raise ModelLoadError(f"model folder {path!r} has no config.json")
        return str(p)
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:
        raise ModelLoadError(f"model path {path!r} does not exist or is not a folder")
    return path


# the tokenizer files of a model folder (the weights, optimizer state and generation config are not read)
_TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_TOKENIZER = ("generation_config.json", "model.safetensors.index.json", "adapter_config.json")
_TOKENIZERS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_TOKENIZERS_KEPT = 16
_LEASABLE: "collections.OrderedDict[str, list]" = collections.OrderedDict()  # fingerprint -> tokenizers not in use


_FINGERPRINTS: dict[tuple, str] = {}  # (folder, its tokenizer files' (name, size, mtime_ns)) -> fingerprint


def tokenizer_fingerprint(resolved: str) -> str:
    """What identifies a tokenizer: for a local folder, sha256 of the names and bytes of its
    top-level files a tokenizer may read (``*.json`` but the generation config and weight index,
    ``*.txt``, ``*.model``, ``*.jinja``, ``*.tiktoken``); else (a hub id) the id itself. Two
    checkpoints of one run hold the same tokenizer files, so they share one fingerprint. The
    files are hashed once per folder and file sizes and modification times (a Qwen tokenizer.json
    is 7 MB); later calls only read the folder's listing."""
    folder = Path(resolved)
    if not folder.is_dir():
        return f"id:{resolved}"
    files = sorted(f for f in folder.iterdir()
                   if f.is_file() and f.suffix in _TOKENIZER_SUFFIXES and f.name not in _NOT_TOKENIZER)
    stats = (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    found = _FINGERPRINTS.get(stats)
    if found is None:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}\0".encode())
            h.update(f.read_bytes())
        found = _FINGERPRINTS[stats] = f"sha256:{h.hexdigest()}"
    return found


def load_tokenizer(path: str):
    """Tokenizer of ``path`` with a pad token set (EOS when the model has none) and left padding.

    Loaded once per thread and ``tokenizer_fingerprint`` (the last 16 kept): a resident worker
    and a run's stages ask for the same tokenizer every iteration, and a fast tokenizer's load
    (about 0.2 s for SmolLM2's) was paid each time (issue 44). Per thread, since a fast
    tokenizer's Rust object is not safe to call from two threads at once (its padding and
    truncation settings are set on each call; transformers' ``PreTrainedTokenizerFast``); the
    key is the ``threading.Thread`` object, not its ident, which a new thread may reuse while a
    model or engine built on the ended thread still holds and calls its tokenizer. The same
    object is returned to every caller of a thread: callers must not change its settings. A
    caller that holds it only for a block: ``leased_tokenizer``.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded.
    """
    with LOAD_LOCK:
        resolved = resolve_model_path(path)
        key = (threading.current_thread(), tokenizer_fingerprint(resolved))
        tok = _TOKENIZERS.get(key)
        if tok is not None:
            _TOKENIZERS.move_to_end(key)
            return tok
        tok = _TOKENIZERS[key] = _new_tokenizer(path, resolved)
        while len(_TOKENIZERS) > _TOKENIZERS_KEPT:
            _TOKENIZERS.popitem(last=False)
    return tok


def _new_tokenizer(path: str, resolved: str):
    """A freshly loaded ``prepare_tokenizer`` tokenizer (call under ``LOAD_LOCK``).

    Raises:
        ModelLoadError: the tokenizer cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return prepare_tokenizer(AutoTokenizer.from_pretrained(resolved))
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {path!r} ({resolved}): {exc}") from exc


@contextlib.contextmanager
def leased_tokenizer(path: str) -> Iterator[Any]:
    """``load_tokenizer``'s tokenizer of ``path``, this ``with`` block's alone, for a caller that
    keeps no reference to it after the block (a stage rendering its prompts, one that needs the
    pad id). On exit it goes back to a pool per ``tokenizer_fingerprint`` (the last 16 kept)
    that any thread's next block takes it from. ``load_tokenizer``'s per-thread cache missed for
    these callers: each iteration's Prefect tasks run on new threads (a task runner's pool lives
    for one flow run), so the log-prob, critic and prompts stages loaded a tokenizer every
    iteration (0.3-0.7 s each on 2 cores for SmolLM2's, issue 44). A leased tokenizer is never
    one that ``load_tokenizer`` returned, which a model, engine or trainer may hold and use from
    another thread; a fast tokenizer must not be called from two threads at once. Callers must
    not change its settings.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded.
    """
    with LOAD_LOCK:
        resolved = resolve_model_path(path)
        fingerprint = tokenizer_fingerprint(resolved)
        free = _LEASABLE.get(fingerprint)
        tok = free.pop() if free else _new_tokenizer(path, resolved)
    try:
        yield tok
    finally:
        with LOAD_LOCK:
            _LEASABLE.setdefault(fingerprint, []).append(tok)
            _LEASABLE.move_to_end(fingerprint)
            while len(_LEASABLE) > _TOKENIZERS_KEPT:
                _LEASABLE.popitem(last=False)


def pad_token_id(path: str) -> int | None:
    """The id ``load_tokenizer(path)`` pads with (its pad token, else EOS: ``prepare_tokenizer``),
    from a leased tokenizer (``leased_tokenizer``), for stages that need nothing else of it.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded.
    """
    with leased_tokenizer(path) as tok:
        return tok.pad_token_id


_SHELL: contextvars.ContextVar[bool] = contextvars.ContextVar("rft_meta_shell", default=False)


@contextlib.contextmanager
def meta_shell() -> Iterator[None]:
    """Within it, ``load_pretrained`` reads a model's config but not its weights: it builds the
    same class from the config on the meta device (``with torch.device("meta"): from_config``,
    the context transformers 5.24's own ``from_pretrained`` builds in, so tied weights stay one
    parameter), and the loaders built on it (``load_causal_lm``, ``load_critic``, a LoRA
    policy's base) count no model load. What the loaders do after it (peft's adapters, a critic's
    value head, ``set_trainable``) runs on the meta tensors as on real ones. For the ranks of an
    FSDP2 job that receive their shards from rank 0 (``rft_core.training.fsdp.weights_on_rank0``);
    the checkpoint folders of a run are then resolved without their weight files
    (``rft_core.stages.checkpoints``)."""
    token = _SHELL.set(True)
    try:
        yield
    finally:
        _SHELL.reset(token)


def building_shell() -> bool:
    """Whether this thread is inside ``meta_shell`` (no weight file is read)."""
    return _SHELL.get()


def count_model_load(path: str) -> None:
    """Count a model load of ``path`` and the bytes of its weight files
    (``rft_core.counters.counts``), unless inside ``meta_shell`` (nothing is read)."""
    if not building_shell():
        count("model_loads")
        count_bytes_read(resolve_model_path(path))


def load_pretrained(auto_cls, path: str, *, dtype: str = "float32", trainable: bool = False, what: str = "model",
                    adjust_config=None, model_kwargs: dict | None = None):
    """Load ``auto_cls.from_pretrained(path)`` under the process-wide load lock; inside
    ``meta_shell``, ``auto_cls.from_config`` of its config on the meta device instead.

    Args:
        auto_cls: a transformers Auto class (AutoModelForCausalLM, AutoModelForTokenClassification).
        adjust_config: optional callable(config) -> config applied before loading.
        model_kwargs: extra ``from_pretrained`` keyword arguments (e.g. attn_implementation).
        trainable: False puts the model in eval mode with gradients off.
    Raises:
        ModelLoadError: unreadable path, config or weights, named in the message.
    """
    from transformers import AutoConfig

    quiet_transformers()
    with LOAD_LOCK:
        resolved = resolve_model_path(path)
        try:
            if building_shell():
                config = AutoConfig.from_pretrained(resolved)
                with torch.device("meta"):
                    model = auto_cls.from_config(adjust_config(config) if adjust_config else config,
                                                 dtype=torch_dtype(dtype), **(model_kwargs or {}))
            else:
                kwargs = {}
                if adjust_config is not None:
                    kwargs["config"] = adjust_config(AutoConfig.from_pretrained(resolved))
                model = auto_cls.from_pretrained(resolved, dtype=torch_dtype(dtype), **kwargs, **(model_kwargs or {}))
        except Exception as exc:
            raise ModelLoadError(f"cannot load {what} from {path!r} ({resolved}): {exc}") from exc
    return set_trainable(model, trainable)
