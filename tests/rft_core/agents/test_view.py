"""One trajectory as text, turn by turn (rft_core.agents.view)."""
from __future__ import annotations

import pytest

from rft_core.agents.view import render_trajectory, segments
from rft_core.models.loading import load_tokenizer


def test_segments_are_the_runs_of_the_mask():
    assert segments([]) == []
    assert segments([True]) == [(True, 0, 1)]
    assert segments([True, True, False, False, False, True, False]) == [(True, 0, 2), (False, 2, 5), (True, 5, 6),
                                                                       (False, 6, 7)]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def _row(tok):
    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    turn1, obs, turn2 = ids("<calc>378 * 937</calc>"), ids("<|im_end|>\n<|im_start|>tool\n354186<|im_end|>\n<|im_start|>assistant\n"), ids("Answer: 354186<|im_end|>")
    response = turn1 + obs + turn2
    return {"sample_id": "q7#2", "prompt_id": "q7", "response_token_ids": response,
            "action_mask": [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2),
            "tool_calls": [{"turn": 1, "name": "calculator", "arguments": '{"expression": "378 * 937"}',
                            "observation": "354186", "error": None, "seconds": 0.0012}],
            "num_turns": 2, "finish_reason": "stop", "env_reward": 0.0, "env_fallback": False, "env_error": None,
            "response_text": "Answer: 354186", "transcript": tok.decode(response, skip_special_tokens=False)}, (turn1, obs, turn2)


def test_render_with_a_tokenizer_shows_each_turn_the_call_and_the_observation(tok):
    row, (turn1, obs, turn2) = _row(tok)
    text = render_trajectory(row, tokenizer=tok, prompt={"question": "Calculate 378 * 937.", "answer": "354186"},
                             reward={"rewards": 1.1, "correct": True, "extracted_answer": "354186",
                                     "reward_metrics": [("correctness", 1.0), ("format", 1.0)]})
    lines = text.splitlines()
    assert lines[0] == (f"sample q7#2 (prompt q7): 2 model turn(s), {len(turn1) + len(turn2)} model + {len(obs)} "
                        "observation tokens, finish_reason stop")
    assert lines[1:3] == ["question: Calculate 378 * 937.", "answer (label): 354186"]
    assert lines[3:6] == [f"--- model turn 1 ({len(turn1)} tokens)", "<calc>378 * 937</calc>",
                          '  step of turn 1: calculator({"expression": "378 * 937"}) -> observation "354186"  [0.001 s]']
    assert lines[6] == f"--- observation ({len(obs)} tokens, not trained on)"
    assert "<|im_start|>tool\n354186<|im_end|>" in text
    assert f"--- model turn 2 ({len(turn2)} tokens)\nAnswer: 354186<|im_end|>" in text
    assert lines[-3:] == ['--- final answer (what the reward stage grades): "Answer: 354186"', "env_reward 0",
                          "reward 1.1 (correct, extracted '354186'); per source {\"correctness\": 1.0, \"format\": 1.0}"]


def test_render_without_a_tokenizer_prints_the_transcript_and_the_steps(tok):
    row, _ = _row(tok)
    row = {**row, "env_fallback": True, "env_reward": 0.5, "env_error": "environment 'remote' failed",
           "tool_calls": row["tool_calls"] + [{"turn": 2, "name": None, "arguments": "", "observation": None,
                                               "error": "ConnectionError: down", "seconds": 2.0}]}
    text = render_trajectory(row)
    assert "--- transcript (model turns and observations, special tokens kept)\n" + row["transcript"] in text
    assert '  step of turn 2: no tool call parsed -> error "ConnectionError: down"  [2.000 s]' in text
    assert text.endswith("env_reward 0.5 (fallback), env_error environment 'remote' failed")


def test_render_refuses_a_mask_of_another_length(tok):
    row, _ = _row(tok)
    with pytest.raises(ValueError, match="q7#2: .* response tokens but .* action_mask entries"):
        render_trajectory({**row, "action_mask": row["action_mask"][:-1]}, tokenizer=tok)
