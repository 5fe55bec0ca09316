"""FLOPs of a GRPO step (benchmarks/flops.py, issue 19) on a hand-computed tiny shape, and the
report's distance-to-the-limit lines on a synthetic result (benchmarks/vs_trl_report.py).

The tiny shape: d = 4, one layer, d_ff = 8, 2 query heads and 1 key/value head of width 2,
vocabulary 10. Per token per layer: projections 2*4*4 (q) + 2*2*4*2 (k, v) + 2*4*4 (o) = 96
(= 2*d*(2*d + 2*d_kv)), SwiGLU MLP 2*3*4*8 = 192, so 288; attention 4*4 = 16 per attended
token; lm_head 2*4*10 = 80 per position with logits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.flops import (
    ModelDims,
    body_flops_per_token,
    forward_flops,
    generation_flops,
    logprob_pass_flops,
    step_flops,
    update_flops,
)

TINY = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 10, "tie_word_embeddings": True}


@pytest.fixture
def tiny() -> ModelDims:
    return ModelDims.from_config(TINY)


def test_dims_from_dict_and_config_object(tiny):
    assert tiny.head_dim == 2  # hidden_size // num_attention_heads
    assert ModelDims.from_config(SimpleNamespace(**TINY, head_dim=None)) == tiny
    assert ModelDims.from_config(tiny.to_dict()) == tiny
    no_gqa = ModelDims.from_config({k: v for k, v in TINY.items() if k != "num_key_value_heads"})
    assert no_gqa.num_key_value_heads == 2


def test_per_token_and_pass_counts(tiny):
    assert body_flops_per_token(tiny) == 96 + 192
    # 3 positions, causal: 1 + 2 + 3 = 6 attended tokens; logits at 2 of them
    assert forward_flops(tiny, 3, 2) == 3 * 288 + 16 * 6 + 80 * 2
    # prompt 3, response 2: generation feeds 3 + 2 - 1 = 4 positions (1+2+3+4 = 10 attended), logits at 2
    assert generation_flops(tiny, 3, 2) == 4 * 288 + 16 * 10 + 80 * 2 == 1472
    # a log-prob pass feeds all 5 tokens (15 attended), logits at the 2 response positions
    assert logprob_pass_flops(tiny, 3, 2) == 5 * 288 + 16 * 15 + 80 * 2 == 1840
    assert update_flops(tiny, 3, 2) == 3 * 1840
    # prompt 1, response 1: generation is the prefill alone; the pass sees 2 tokens
    assert generation_flops(tiny, 1, 1) == 288 + 16 + 80 == 384
    assert logprob_pass_flops(tiny, 1, 1) == 2 * 288 + 16 * 3 + 80 == 704
    assert generation_flops(tiny, 5, 0) == logprob_pass_flops(tiny, 5, 0) == 0


def test_layers_scale_the_body_not_the_lm_head():
    two = ModelDims.from_config({**TINY, "num_hidden_layers": 2})
    assert logprob_pass_flops(two, 3, 2) == 2 * (5 * 288 + 16 * 15) + 80 * 2


def test_step_flops_by_passes(tiny):
    samples = [(3, 2), (1, 1)]
    gen, lp = 1472 + 384, 1840 + 704
    # ours by default and TRL with num_iterations=1: generation, reference pass, update
    assert step_flops(tiny, samples) == {"generation": gen, "actor_logprobs": 0, "ref_logprobs": lp,
                                         "update": 3 * lp, "total": gen + 4 * lp}
    # the actor (old log-prob) pass recomputed, and two update epochs
    both = step_flops(tiny, samples, {"actor_logprobs": 1, "update": 2})
    assert both["actor_logprobs"] == lp and both["update"] == 6 * lp and both["total"] == gen + 8 * lp
    assert step_flops(tiny, samples, {"ref_logprobs": 0.5})["ref_logprobs"] == lp // 2


def test_report_lines_from_a_synthetic_result():
    from benchmarks.vs_trl_report import flops_section

    # 12032 FLOPs (test_step_flops_by_passes) in a microsecond: 12.032 GFLOP/s
    step = {"seconds": 1e-6, "samples": [[3, 2], [1, 1]], "passes": {"actor_logprobs": 0, "ref_logprobs": 1},
            "stages": {"rollout": {"compute": 2.5e-7}, "ppo_update": {"compute": 5e-7}}}
    res: dict[str, dict] = {"ours": {"model": TINY, "steps": [step]},
                            "old": {"steps": [{"seconds": 1.0}]}}  # "old": no token counts
    gemm = {"gflops_median": 100.0, "gflops_best": 110.0, "gflops_rounds": [100.0], "n": 8, "threads": 1}
    lines = flops_section(res, False, gemm, {**gemm, "gflops_median": 80.0})
    assert any("100.0 (best round 110.0) before the runs, 80.0 (best round 110.0) after" in x for x in lines)
    rows = [x for x in lines if x.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["framework", "ours"]  # "old" is left out
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    # passes, TFLOP generation / log-prob passes / update / total, GFLOP/s, fraction, generation and update GFLOP/s
    assert cells[1:] == ["ref", "0.00", "0.00", "0.00", "0.00", "12.0", "12.0%", "7.4", "15.3"]
    assert flops_section({"old": res["old"]}, False, None, None) == []


def test_body_is_two_flops_per_weight_of_a_real_llama():
    """Independent check on transformers' own Llama (GQA, SwiGLU): the per-token body FLOPs are 2 per
    weight of the decoder layers' linear maps (Kaplan's 2N), the lm_head 2 per weight of its matrix."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, intermediate_size=40, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    dims = ModelDims.from_config(cfg)
    assert body_flops_per_token(dims) == 2 * linear
    assert forward_flops(dims, 1, 1) == 2 * linear + 4 * 16 * 2 + 2 * model.lm_head.weight.numel()
