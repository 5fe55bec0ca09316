"""The model a GPU inference engine holds for a Llama / Qwen2 checkpoint: fused, tensor-parallel
sharded parameters loaded from HF-named tensors by the engine's own ``load_weights``.

Copied from vLLM 0.33.0 (``vllm/model_executor/models/llama.py``, ``qwen2.py``: the
``hf_to_vllm_mapper`` / ``stacked_params_mapping``; ``vllm/model_executor/layers/linear.py``:
``QKVParallelLinear.weight_loader``, ``MergedColumnParallelLinear.weight_loader``,
``RowParallelLinear.weight_loader``; ``vllm/model_executor/layers/vocab_parallel_embedding.py``:
``VocabParallelEmbedding`` with its vocabulary padded to a multiple of 64 and
``weight_loader``; ``vllm/model_executor/model_loader/weight_utils.py``:
``default_weight_loader``) and SGLang 0.5.23 (``sglang/srt/models/qwen2.py``,
``Qwen2ForCausalLM._legacy_load_weights``, whose layers are the same copies of vLLM's):

- names: ``model.layers.<i>.self_attn.qkv_proj.{weight,bias}`` (q, k, v stacked),
  ``.self_attn.o_proj.weight``, ``.mlp.gate_up_proj.weight`` (gate, up stacked),
  ``.mlp.down_proj.weight``, the two layer norms, ``model.embed_tokens.weight``, ``model.norm.weight``
  and ``lm_head.weight`` (none when the embeddings are tied: ``lm_head.tie_weights``);
- shards of rank r of tp: q heads ``[r * H/tp, (r+1) * H/tp)``, k/v heads ``r // replicas`` (kv
  heads replicated when there are fewer than tp), gate/up rows ``[r * I/tp, ...)``, o/down
  columns ``[r * X/tp, ...)``, vocabulary rows ``[r * V'/tp, ...)`` of the padded vocabulary
  ``V'`` (rows past the real vocabulary zero);
- loading: a loader narrows the HF tensor to its shard and asserts the shapes agree
  (``assert param_data.shape == loaded_weight.shape``; ``narrow`` itself fails on a tensor too
  small); a replicated parameter asserts "Attempted to load weight (...) into parameter (...)";
- unknown names: vLLM's ``AutoWeightsLoader`` raises ``ValueError("There is no module or
  parameter named ...")`` (an unexpected ``.bias`` is ignored; a tied ``lm_head.weight`` is
  skipped); SGLang's default loader (``_legacy_load_weights``) logs "Parameter ... not found in
  params_dict" and goes on, its newer one (``_load_weights_v2``, taken when
  ``SGLANG_ENABLE_WEIGHT_LOADER_V2`` is set: ``sglang/srt/environ.py``, off by default; its
  ``AutoWeightsLoader`` in ``sglang/srt/models/utils.py``) raises ``ValueError("No module or
  parameter named ...")`` (an unexpected ``.bias`` or ``.kv_scale`` ignored). None checks that
  every parameter was loaded: vLLM and SGLang's newer loader return the names they loaded (the
  caller checks), SGLang's default one returns nothing;
- memory: a model whose GPU memory is unmapped (``unmapped``: vLLM's sleep mode,
  ``vllm/device_allocator/cumem.py``) cannot be written: "CUDA error: an illegal memory access
  was encountered".

Not modelled: quantization, pipeline parallelism, the forward pass (``to_hf`` rebuilds the HF
state dict from every rank's shards; the stand-in engines generate with an HF model holding it).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("tests.standins.engine_model")

VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
STACKED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
           (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """vLLM's (weight_utils.py) and SGLang's replicated-parameter loader."""
    assert param.size() == loaded.size(), f"Attempted to load weight ({loaded.size()}) into parameter ({param.size()})"
    param.data.copy_(loaded)


class EngineModel(torch.nn.Module):
    """Rank ``tp_rank`` of ``tp_size`` of the engine's model of the HF ``config`` (Llama or Qwen2),
    in ``dtype``, its parameters zero until loaded. ``flavour``: ``"vllm"``, ``"sglang"`` or
    ``"sglang_v2"`` (SGLang's newer loader): how unknown names are treated, see the module docstring."""

    def __init__(self, config, *, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                 flavour: str = "vllm") -> None:
        super().__init__()
        c = config
        self.config, self.tp_rank, self.tp_size, self.flavour = c, tp_rank, tp_size, flavour
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.heads, self.kv_total = c.num_attention_heads // tp_size, c.num_key_value_heads
        self.kv_replicas = max(1, tp_size // self.kv_total)
        self.kv_heads = max(1, self.kv_total // tp_size)
        self.inter = c.intermediate_size // tp_size
        self.vocab = c.vocab_size
        self.vocab_per_rank = _pad(c.vocab_size, VOCAB_PADDING * tp_size) // tp_size
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        bias = bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2"
        h, d = c.hidden_size, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * d

        def p(*shape):
            return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        params = {"model.embed_tokens.weight": p(self.vocab_per_rank, h), "model.norm.weight": p(h)}
        for i in range(c.num_hidden_layers):
            pre = f"model.layers.{i}."
            params |= {pre + "self_attn.qkv_proj.weight": p(qkv, h), pre + "self_attn.o_proj.weight": p(h, self.heads * d),
                       pre + "mlp.gate_up_proj.weight": p(2 * self.inter, h), pre + "mlp.down_proj.weight": p(h, self.inter),
                       pre + "input_layernorm.weight": p(h), pre + "post_attention_layernorm.weight": p(h)}
            if bias:
                params[pre + "self_attn.qkv_proj.bias"] = p(qkv)
        if not self.tied:
            params["lm_head.weight"] = p(self.vocab_per_rank, h)
        self.loads = 0  # load_weights calls
        self.unmapped = False  # its GPU memory is unmapped (a sleeping vLLM engine): writing it is an illegal access
        self.cuda_error: str | None = None  # a CUDA error is sticky: the process can do nothing more
        self._names = list(params)
        self._params = torch.nn.ParameterDict({n.replace(".", "__"): v for n, v in params.items()})

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # noqa: D102
        for n in self._names:
            yield n, self._params[n.replace(".", "__")]

    def param(self, name: str) -> torch.nn.Parameter:
        return self._params[name.replace(".", "__")]

    # -- loaders (linear.py / vocab_parallel_embedding.py) -------------------------------------
    def _load_vocab(self, param, loaded):
        assert loaded.shape[0] == self.vocab
        start = self.tp_rank * self.vocab_per_rank
        size = max(0, min(start + self.vocab_per_rank, self.vocab) - start)
        loaded = loaded.narrow(0, start, size)
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0]:].data.fill_(0)

    def _load_qkv(self, param, loaded, shard):
        d = self.head_dim
        offset, size = {"q": (0, self.heads * d), "k": (self.heads * d, self.kv_heads * d),
                        "v": ((self.heads + self.kv_heads) * d, self.kv_heads * d)}[shard]
        rank = self.tp_rank if shard == "q" else self.tp_rank // self.kv_replicas
        data = param.data.narrow(0, offset, size)
        loaded = loaded.narrow(0, rank * size, size)
        assert data.shape == loaded.shape
        data.copy_(loaded)

    def _load_gate_up(self, param, loaded, shard):
        data = param.data.narrow(0, shard * self.inter, self.inter)
        loaded = loaded.narrow(0, self.tp_rank * self.inter, self.inter)
        assert data.shape == loaded.shape
        data.copy_(loaded)

    def _load_row(self, param, loaded):
        size = param.shape[1]
        loaded = loaded.narrow(1, self.tp_rank * size, size)
        assert param.data.shape == loaded.shape
        param.data.copy_(loaded)

    def _load(self, name: str, loaded: torch.Tensor, shard) -> None:
        param = self.param(name)
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            self._load_qkv(param, loaded, shard)
        elif name.endswith("gate_up_proj.weight"):
            self._load_gate_up(param, loaded, shard)
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            self._load_row(param, loaded)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            self._load_vocab(param, loaded)
        else:
            default_weight_loader(param, loaded)

    def load_weights(self, weights):
        """``load_weights(weights: Iterable[tuple[str, Tensor]])``: vLLM returns the set of the
        (fused) parameter names it loaded; SGLang returns None (see the module docstring)."""
        if self.unmapped:
            self.cuda_error = "CUDA error: an illegal memory access was encountered"
            raise RuntimeError(self.cuda_error)
        self.loads += 1
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tied:  # aliased to the embedding: skipped
                continue
            target, shard = name, None
            for old, new, sid in STACKED:
                if old in name:
                    target, shard = name.replace(old, new, 1), sid
                    break
            if target.replace(".", "__") not in self._params:
                if target.endswith(".bias") or (self.flavour == "sglang_v2" and target.endswith(".kv_scale")):
                    continue
                if self.flavour == "vllm":
                    raise ValueError(f"There is no module or parameter named {target!r} in {type(self).__name__}")
                if self.flavour == "sglang_v2":
                    raise ValueError(f"No module or parameter named {self._missing_prefix(target)!r} in "
                                     f"{type(self).__name__}.")
                log.warning("Parameter %s not found in params_dict", target)
                continue
            self._load(target, tensor, shard)
            loaded.add(target)
        return None if self.flavour == "sglang" else loaded

    def _missing_prefix(self, name: str) -> str:
        """The first prefix of ``name`` that no parameter has (where ``AutoWeightsLoader`` stops)."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not any(n == prefix or n.startswith(prefix + ".") for n in self._names):
                return prefix
        return name


def to_hf(shards: list[EngineModel]) -> dict[str, torch.Tensor]:
    """The HF state dict (tied weights under the embedding's name only) that the ranks' shards
    ``shards`` (rank order) hold together: what the engine serves."""
    first = shards[0]
    c, d = first.config, first.head_dim
    out: dict[str, torch.Tensor] = {}

    def cat(name, dim, part=lambda t: t):
        return torch.cat([part(s.param(name).data) for s in shards], dim=dim)

    out["model.embed_tokens.weight"] = cat("model.embed_tokens.weight", 0)[: first.vocab]
    if not first.tied:
        out["lm_head.weight"] = cat("lm_head.weight", 0)[: first.vocab]
    out["model.norm.weight"] = first.param("model.norm.weight").data.clone()
    kv_owner = list(range(0, first.tp_size, first.kv_replicas))  # one rank per distinct kv head group
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            name = pre + f"self_attn.qkv_proj.{kind}"
            if name.replace(".", "__") not in first._params:
                continue
            q, k, v = first.heads * d, first.kv_heads * d, first.kv_heads * d
            out[pre + f"self_attn.q_proj.{kind}"] = torch.cat([s.param(name).data[:q] for s in shards])
            out[pre + f"self_attn.k_proj.{kind}"] = torch.cat([shards[r].param(name).data[q:q + k] for r in kv_owner])
            out[pre + f"self_attn.v_proj.{kind}"] = torch.cat([shards[r].param(name).data[q + k:q + k + v]
                                                               for r in kv_owner])
        out[pre + "self_attn.o_proj.weight"] = cat(pre + "self_attn.o_proj.weight", 1)
        out[pre + "mlp.gate_proj.weight"] = cat(pre + "mlp.gate_up_proj.weight", 0, lambda t: t[:first.inter])
        out[pre + "mlp.up_proj.weight"] = cat(pre + "mlp.gate_up_proj.weight", 0, lambda t: t[first.inter:])
        out[pre + "mlp.down_proj.weight"] = cat(pre + "mlp.down_proj.weight", 1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[pre + f"{norm}.weight"] = first.param(pre + f"{norm}.weight").data.clone()
    return out


def load_hf_into(hf_model: torch.nn.Module, shards: list[EngineModel]) -> None:
    """Make the HF model ``hf_model`` hold what ``shards`` hold (in its own dtype)."""
    state = to_hf(shards)
    if "lm_head.weight" not in state and "lm_head.weight" in hf_model.state_dict():
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.no_grad():
        hf_model.load_state_dict({k: v.to(hf_model.dtype) for k, v in state.items()}, strict=True)
