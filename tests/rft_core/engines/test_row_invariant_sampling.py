"""The HF engine's sampled rows do not depend on when the other rows of their batch end (rollout
contract v6): every decode step draws one uniform per batch row, finished rows included, and row r
samples with the r-th. Before, each step drew one per row still generating, so a row that ended a
step earlier in one run (a token moved by float rounding, as after an update summed on other
ranks) shifted every other row's draws: in the demo preset's FSDP2 run 25 of 32 responses of
iteration 2 diverged from one changed token (docs/scale.md, "FSDP2 or DeepSpeed")."""
from __future__ import annotations

import pytest

from rft_core.engines.hf import HFEngine

PROMPTS = [[1, 20, 30, 31], [1, 40, 41, 42]]  # the same length: no padding differs between the runs


def _generate(engine: HFEngine):
    return engine.generate(PROMPTS, n_samples_per_prompt=1, max_new_tokens=16, temperature=1.0, batch_size=2,
                           seed=5, sort_by_length=False, share_prefill=False)


def test_a_row_that_ends_early_leaves_the_other_rows_draws_alone(parts):
    model, tok = parts
    engine = HFEngine(model, tok)
    engine.eos_ids = {tok.vocab_size + 7}  # no token ends a row: both run 16 steps
    full = _generate(engine)
    a, b = (g.response_token_ids for g in full)
    assert len(a) == len(b) == 16
    # make row b end at its 4th token: an EOS id that row a never samples
    stop = next(t for t in b[3:] if t not in a)
    end = b.index(stop)
    assert end < 15
    engine.eos_ids = {stop}
    early = _generate(engine)
    assert early[1].response_token_ids == b[:end + 1]  # row b ended there
    # row a: the same tokens and log-probs as when b ran to the end (its draws did not shift)
    assert early[0].response_token_ids == a
    # while both rows decode, row a's log-probs are computed exactly as before; after b ended, the
    # steps run on a batch of one row, whose other matmul shapes may round otherwise (1e-6 at the
    # last step on an AVX-512 CPU, 2026-12-02)
    assert early[0].logprobs[:end + 1] == full[0].logprobs[:end + 1]
    assert early[0].logprobs == pytest.approx(full[0].logprobs, abs=1e-5, rel=0)
