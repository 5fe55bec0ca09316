"""Chunked log-probs and entropies (``token_logprobs``): equal to the unchunked float32
computation (values and gradients, random logits and the tiny model, padded and packed), exact
gradients (gradcheck in float64), bad input refused, and the extra memory they allocate is a few
(chunk, V) float32 temporaries, not a (B, T, V) float32 copy."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import (
    build_packed_batch,
    build_token_batch,
    default_chunk_size,
    response_logprobs,
    token_logprobs,
)


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The unchunked computation: a full (..., V) log-softmax (float32, float64 for float64)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _random(shape, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(*shape, V, generator=g)).to(dtype)
    return logits, torch.randint(0, V, shape, generator=g)


def _run(logits, targets, temperature, chunk_size, w_lp, w_ent):
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, targets, temperature=temperature, with_entropy=True, chunk_size=chunk_size)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("chunk_size", [1, 3, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked_values_and_gradients(chunk_size, temperature):
    """Chunks of 1, 3, 7 positions against one chunk holding all 27 positions (the unchunked
    computation), to 1e-6; both against a float32 full log-softmax (autograd through it) to
    1e-6 plus float32 summation-order rounding (1e-6 relative), and against float64."""
    logits, targets = _random((3, 9), 257, seed=0)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    lp, ent, grad = _run(logits, targets, temperature, chunk_size, w_lp, w_ent)
    one_lp, one_ent, one_grad = _run(logits, targets, temperature, 10**6, w_lp, w_ent)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (3, 9)
    for got, want in [(lp, one_lp), (ent, one_ent), (grad, one_grad)]:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)

    ref_in = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, targets, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    for got, want in [(lp, ref_lp), (ent, ref_ent), (grad, ref_in.grad)]:
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)

    f64_lp, f64_ent = _reference(logits.double(), targets, temperature)
    torch.testing.assert_close(lp.double(), f64_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent.double(), f64_ent, atol=2e-6, rtol=0)


def test_gradient_of_logprobs_alone_and_entropy_alone():
    logits, targets = _random((5,), 31, seed=2)
    for use_lp, use_ent in [(True, False), (False, True)]:
        ref_in = logits.clone().requires_grad_(True)
        r_lp, r_ent = _reference(ref_in, targets, 1.3)
        (r_lp.sum() if use_lp else r_ent.sum()).backward()
        x = logits.clone().requires_grad_(True)
        lp, ent = token_logprobs(x, targets, temperature=1.3, with_entropy=use_ent, chunk_size=2)
        (lp.sum() if use_lp else ent.sum()).backward()
        torch.testing.assert_close(x.grad, ref_in.grad, atol=1e-6, rtol=1e-6)
    assert token_logprobs(logits, targets)[1] is None


def test_gradcheck_float64():
    """Finite differences against the analytic backward (float64 logits are computed in float64)."""
    logits, targets = _random((2, 4), 9, seed=3, dtype=torch.float64)
    x = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: token_logprobs(t, targets, temperature=0.6, with_entropy=True, chunk_size=3), (x,))


def test_entropy_and_logprob_of_a_hand_computed_distribution():
    # logits log(1), log(2), log(5): p = (1/8, 2/8, 5/8)
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]]))
    lp, ent = token_logprobs(logits, torch.tensor([2]), with_entropy=True, chunk_size=1)
    p = torch.tensor([1 / 8, 2 / 8, 5 / 8], dtype=torch.float64)
    assert lp.item() == pytest.approx(float(torch.log(p[2])), abs=1e-6)
    assert ent.item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


def test_bfloat16_logits_stay_bfloat16_and_match_their_float32_values():
    logits, targets = _random((4, 6), 128, seed=4, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, targets, temperature=0.9, with_entropy=True, chunk_size=5)
    (lp.sum() + ent.sum()).backward()
    ref_in = logits.float().requires_grad_(True)
    r_lp, r_ent = _reference(ref_in, targets, 0.9)
    (r_lp.sum() + r_ent.sum()).backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, r_lp, atol=1e-6, rtol=0)  # bf16 -> f32 is exact
    torch.testing.assert_close(ent, r_ent, atol=1e-6, rtol=0)
    torch.testing.assert_close(x.grad.float(), ref_in.grad, atol=0, rtol=2 ** -7)  # bf16 rounding of the grad


def test_bad_input_is_refused():
    logits, targets = _random((2, 3), 11, seed=5)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 11\) do not match targets \(2, 4\)"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        token_logprobs(logits, targets, chunk_size=0)
    assert default_chunk_size(49152) == 341 and default_chunk_size(10**9) == 1


def test_tiny_model_padded_and_packed_chunked_equal_unchunked(tiny_model):
    """On the tiny Llama (V = 49,152): chunks of 1 and 4 positions against the default chunk,
    which holds all 18 positions of the batch (unchunked), to 1e-6 (absolute, and relative: an
    entropy near log V = 10.8 is summed over 49,152 float32 terms, whose order the CPU kernels
    pick by tensor shape, so its last bits move) for log-probs, entropies and the gradient of
    every parameter; all of them against autograd through a full float32 log-softmax, to 1e-6
    plus 5e-6 relative."""
    model = load_causal_lm(tiny_model, trainable=True)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    responses = [[20, 21, 22], [23], [24, 25, 26, 27, 28]]
    b = build_token_batch(prompts, responses, pad_token_id=2)
    T, mask = b.num_actions, b.action_mask
    assert default_chunk_size(model.config.vocab_size) >= 3 * (T + 1)

    def run(batch, chunk):
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, temperature=0.8, with_entropy=True, chunk_size=chunk)
        ((lp - 0.1 * ent)[mask].sum()).backward()
        return lp[mask].detach(), ent[mask].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    one = run(b, None)
    for chunk in (1, 4):
        got = run(b, chunk)
        torch.testing.assert_close(got[0], one[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], one[1], atol=1e-6, rtol=1e-6)
        for name, grad in one[2].items():
            torch.testing.assert_close(got[2][name], grad, atol=1e-6, rtol=1e-6)
        packed = run(build_packed_batch(prompts, responses), chunk)  # another attention path: 1e-5 (docs/scale.md)
        torch.testing.assert_close(packed[0], one[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[1], one[1], atol=1e-5, rtol=0)

    model.zero_grad()
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    r_lp, r_ent = _reference(out[:, -T - 1:-1], b.input_ids[:, -T:], 0.8)
    ((r_lp - 0.1 * r_ent)[mask].sum()).backward()
    torch.testing.assert_close(one[0], r_lp[mask].detach(), atol=1e-6, rtol=5e-6)
    torch.testing.assert_close(one[1], r_ent[mask].detach(), atol=1e-6, rtol=5e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(one[2][name], p.grad, atol=1e-6, rtol=5e-6)


def _allocations(fn) -> tuple[int, int]:
    """(peak, largest): the peak of bytes allocated and not yet freed while ``fn`` runs, and the
    largest single allocation, from the CPU allocator's events.

    ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's
    CPU allocator as a ``[memory]`` event carrying its signed byte count (+ alloc, - free),
    including the temporaries allocated inside kernels (logsumexp's, softmax's). Replaying them in
    time order gives the live bytes at each instant; tensors that existed before ``fn`` (the
    logits) are not counted, so the peak is the extra memory of the computation.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, max(e.nbytes() for e in events)


def test_extra_memory_is_a_few_chunks_not_a_float32_copy_of_the_logits():
    B, T, V, chunk = 4, 63, 8192, 4
    logits, targets = _random((B, T + 1), V, seed=6, dtype=torch.bfloat16)
    full_f32 = B * T * V * 4  # what logits[:, :-1].float() alone would allocate
    chunk_f32 = chunk * V * 4

    # the measurement sees a (B, T, V) float32 copy when there is one
    old_peak, _ = _allocations(lambda: _reference(logits[:, :-1], targets[:, :-1], 0.7))
    assert old_peak >= 2 * full_f32

    peak, largest = _allocations(lambda: token_logprobs(logits, targets, temperature=0.7, with_entropy=True,
                                                        chunk_size=chunk))
    assert largest <= chunk_f32
    assert peak <= 3 * chunk_f32 + 4 * B * (T + 1) * 4  # a few chunk temporaries + (N,) outputs
    assert peak < full_f32 / 10

    # forward + backward: the gradient of the logits (their dtype, bf16) plus chunk temporaries
    x = logits.clone().requires_grad_(True)

    def forward_backward():
        lp, ent = token_logprobs(x, targets, temperature=0.7, with_entropy=True, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()

    peak, largest = _allocations(forward_backward)
    grad_bytes = x.numel() * x.element_size()
    assert x.grad is not None and largest <= grad_bytes
    assert peak <= grad_bytes + 6 * chunk_f32 + 8 * B * (T + 1) * 4
    assert peak < full_f32 * 0.6
