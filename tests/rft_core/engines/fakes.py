"""Stand-ins for ``vllm.LLM`` and ``sglang.Engine`` (no GPU here), backed by the HF engine, with
the call and output shapes their sources document (see rft_core/engines/vllm.py, sglang.py)."""
from __future__ import annotations

from types import SimpleNamespace

from rft_core.engines.hf import HFEngine
from rft_core.models.loading import load_causal_lm


class SamplingParams(SimpleNamespace):
    """vllm.SamplingParams' keyword arguments, recorded."""


class _HFBacked:
    """One HF sample per (prompt, seed), with the EOS-forcing hook shared by both stand-ins."""

    def __init__(self, model, tok, *, eos_early=None):
        self.hf = HFEngine(model, tok)
        self.eos_early = eos_early  # force this token at step 2 of sample 0 to exercise the EOS cut
        self.events: list[tuple] = []

    def _sample(self, prompt, *, seed, max_tokens, temperature, top_p, force_eos):
        greedy = temperature == 0  # vLLM's and SGLang's argmax decoding
        g = self.hf.generate([prompt], n_samples_per_prompt=1, max_new_tokens=max_tokens,
                             temperature=1.0 if greedy else temperature, top_p=top_p, seed=seed, batch_size=1,
                             greedy=greedy)[0]
        tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
        if force_eos and self.eos_early is not None and len(tokens) >= 3:
            tokens, finish = tokens[:2] + [self.eos_early] + tokens[3:], "length"
        return tokens, lps, finish

    def reload(self, path: str) -> None:
        """Load the checkpoint folder ``path`` into the running model, in place."""
        self.hf.model.load_state_dict(load_causal_lm(path).state_dict())


class HFBackedLLM(_HFBacked):
    """``vllm.LLM`` semantics: one request per prompt with n samples, sample k seeded
    ``seed + k`` (vllm/v1/engine/parallel_sampling.py); CompletionOutputs carry the sampled token
    ids (EOS included), one {token: Logprob} per token and finish_reason "stop"/"length". Also
    ``collective_rpc("rft_reload_weights", args=(path,))``, ``reset_prefix_cache``,
    ``sleep(level)``, ``wake_up(tags)``, ``shutdown``, recorded in ``events``."""

    def __init__(self, model, tok, *, eos_early=None):
        super().__init__(model, tok, eos_early=eos_early)
        self.calls = []
        self.child_seeds: list[int] = []

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        self.calls.append((requests, params, lora_request))
        self.events.append(("generate", len(requests)))
        outs = []
        for req, sp in zip(requests, params):
            assert sp.logprobs == 0 and sp.detokenize is False and sorted(self.hf.eos_ids) == sp.stop_token_ids
            completions = []
            for k in range(sp.n):
                self.child_seeds.append(sp.seed + k)
                tokens, lps, finish = self._sample(req["prompt_token_ids"], seed=sp.seed + k, max_tokens=sp.max_tokens,
                                                   temperature=sp.temperature, top_p=sp.top_p, force_eos=k == 0)
                completions.append(SimpleNamespace(
                    token_ids=tokens, finish_reason=finish, stop_reason=None,
                    logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, lps)]))
            outs.append(SimpleNamespace(outputs=completions))
        return outs

    def collective_rpc(self, method, args=(), kwargs=None):
        self.events.append(("collective_rpc", method, tuple(args)))
        assert method == "rft_reload_weights"
        self.reload(args[0])
        return [None]

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))
        return True

    def sleep(self, level=1):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags) if tags else None))

    def shutdown(self):
        self.events.append(("shutdown",))


class HFBackedSGLang(_HFBacked):
    """``sglang.Engine`` semantics: ``generate(input_ids=[...], sampling_params=[...],
    return_logprob=True, lora_path=[...])`` answers one dict per request with ``output_ids`` and
    ``meta_info`` {``finish_reason``: {"type": "stop", "matched": id} | {"type": "length",
    "length": n}, ``output_token_logprobs``: [(logprob, token_id, None), ...]}; a request's
    ``sampling_params["sampling_seed"]`` seeds it. Control calls answer (success, message, ...)
    tuples as SGLang 0.5.x does; all calls are recorded in ``events``."""

    def __init__(self, model, tok, *, eos_early=None, fail_update=False):
        super().__init__(model, tok, eos_early=eos_early)
        self.calls = []
        self.fail_update = fail_update
        self.adapters: dict[str, str] = {}

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, lora_path=None, **kw):
        assert return_logprob is True and len(input_ids) == len(sampling_params)
        self.calls.append((input_ids, sampling_params, lora_path))
        self.events.append(("generate", len(input_ids)))
        outs = []
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params)):
            assert sp["n"] == 1 and sp["no_stop_trim"] is True and sp["stop_token_ids"] == sorted(self.hf.eos_ids)
            if lora_path is not None:
                assert lora_path[i] in self.adapters
            tokens, lps, finish = self._sample(ids, seed=sp.get("sampling_seed", 0), max_tokens=sp["max_new_tokens"],
                                               temperature=sp["temperature"], top_p=sp["top_p"], force_eos=i == 0)
            reason = {"type": "stop", "matched": tokens[-1]} if finish == "stop" else {"type": "length", "length": len(tokens)}
            outs.append({"output_ids": tokens, "meta_info": {
                "id": str(i), "finish_reason": reason, "prompt_tokens": len(ids), "completion_tokens": len(tokens),
                "output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, lps)]}})
        return outs

    def update_weights_from_disk(self, model_path, load_format=None):
        self.events.append(("update_weights_from_disk", model_path))
        if self.fail_update:
            return False, f"cannot load {model_path}", 0
        self.reload(model_path)
        return True, "Succeeded to update model weights.", 0

    def flush_cache(self):
        self.events.append(("flush_cache",))

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.events.append(("load_lora_adapter", lora_name, lora_path))
        self.adapters[lora_name] = lora_path
        return SimpleNamespace(success=True, error_message=None)

    def unload_lora_adapter(self, lora_name):
        self.events.append(("unload_lora_adapter", lora_name))
        del self.adapters[lora_name]
        return SimpleNamespace(success=True, error_message=None)

    def release_memory_occupation(self, tags=None):
        self.events.append(("release_memory_occupation",))

    def resume_memory_occupation(self, tags=None):
        self.events.append(("resume_memory_occupation",))

    def shutdown(self):
        self.events.append(("shutdown",))
