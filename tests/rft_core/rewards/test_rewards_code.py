"""Code-execution reward on real HumanEval data: canonical solutions pass, wrong ones fail,
and hanging, memory-hungry or harmful responses are stopped within their limits."""
from __future__ import annotations

import time

import pytest

from rft_core.config import CodeExecSource
from rft_core.data.humaneval import HumanEvalDataset
from rft_core.rewards.base import RewardError, RewardSample
from rft_core.rewards.code import CodeExecReward, extract_code, has_code_block, humaneval_program, run_sandboxed


def _sample(i: int, response: str, **kw) -> RewardSample:
    e = HumanEvalDataset(164)[i]
    return RewardSample(sample_id=f"s{i}-{kw.get('tag', 0)}", prompt_id=f"humaneval-{i:06d}", label="humaneval",
                        question=e["question"], prompt_text="<prompt>", response=response, reference=e["answer"],
                        metadata=e["metadata"])


def test_all_canonical_solutions_pass_and_wrong_ones_fail():
    ds = HumanEvalDataset(164)
    src = CodeExecReward(CodeExecSource(timeout_s=10, max_workers=4))
    right = src.score([_sample(i, ds[i]["answer"]) for i in range(164)])
    failed = [(ds[i]["metadata"]["task_id"], s.reason) for i, s in enumerate(right) if s.score != 1.0]
    assert failed == []
    assert all(s.correct is True and s.reason is None for s in right)
    # a wrong body for a handful of problems: each fails on an assertion, reward 0
    wrong = src.score([_sample(i, "    return None\n") for i in (0, 2, 13, 53, 100)])
    assert [s.score for s in wrong] == [0.0] * 5 and all(s.correct is False for s in wrong)
    assert all("AssertionError" in s.reason for s in wrong)


def test_chat_style_responses_are_extracted():
    e = HumanEvalDataset(164)[2]  # truncate_number: return number % 1.0
    fenced = ("Sure! Here is the function:\n\n```python\ndef truncate_number(number: float) -> float:\n"
              "    return number % 1.0\n```\nIt returns the decimals.")
    s = CodeExecReward(CodeExecSource()).score([_sample(2, fenced)])[0]
    assert s.score == 1.0, s.reason
    assert extract_code(fenced, "truncate_number").startswith("def truncate_number")
    prog = humaneval_program(e["metadata"]["prompt"], fenced, e["metadata"]["test"], "truncate_number")
    assert prog.count("def truncate_number") == 2 and prog.rstrip().endswith("check(truncate_number)")
    assert has_code_block(_sample(2, fenced)) == 1.0 and has_code_block(_sample(2, "return 1")) == 0.0


def test_hanging_response_is_stopped_within_its_limit():
    t0 = time.perf_counter()
    r = run_sandboxed("while True:\n    pass\n", timeout_s=1.0)
    took = time.perf_counter() - t0
    assert not r.passed and r.returncode is None and r.reason == "timeout after 1 s"
    assert 0.9 <= took < 3.0
    # a sleeping process is not stopped by the CPU limit, only by the wall-time kill
    r = run_sandboxed("import time\ntime.sleep(30)\n", timeout_s=0.5)
    assert r.reason == "timeout after 0.5 s"


def test_memory_hungry_response_is_stopped():
    r = run_sandboxed("x = bytearray(1024 * 1024 * 1024)\n", memory_mb=256)
    assert not r.passed and r.reason == "out of memory (limit 256 MiB)"
    assert run_sandboxed("x = bytearray(50 * 1024 * 1024)\n", memory_mb=256).passed  # below the limit: fine


@pytest.mark.parametrize("program, reason", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 80))\n", "sandbox: socket.getaddrinfo is not allowed"),
    ("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')\n", "sandbox: urllib.Request is not allowed"),
    ("import os\nos.system('echo pwned')\n", "sandbox: os.system is not allowed"),
    ("import subprocess\nsubprocess.run(['ls'])\n", "sandbox: subprocess.Popen is not allowed"),
    ("import os\nos._exit(0)\n", "sandbox: os._exit is not allowed"),
    ("import sys\nsys.exit(0)\n", "SystemExit: the program called exit(0)"),
    ("import ctypes\nctypes.CDLL(None)\n", "sandbox: ctypes.dlopen is not allowed"),
    ("def f(:\n", "SyntaxError: invalid syntax (solution.py, line 1)"),
    ("raise ValueError('bad')\n", "ValueError: bad"),
])
def test_harmful_or_broken_programs_fail_with_a_reason(program, reason):
    r = run_sandboxed(program)
    assert (r.passed, r.reason) == (False, reason)


def test_no_access_to_the_run_files(tmp_path):
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("weights")
    read = run_sandboxed(f"print(open({str(secret)!r}).read())\n")
    assert not read.passed and read.reason == f"sandbox: open {str(secret)!r} for reading is not allowed"
    write = run_sandboxed(f"open({str(tmp_path / 'x.txt')!r}, 'w').write('x')\n")
    assert not write.passed and "for writing is not allowed" in write.reason and not (tmp_path / "x.txt").exists()
    delete = run_sandboxed(f"import os\nos.remove({str(secret)!r})\n")
    assert "os.remove" in delete.reason and secret.read_text() == "weights"
    listing = run_sandboxed(f"import os\nos.listdir({str(tmp_path)!r})\n")
    assert "os.listdir" in listing.reason
    # its own temporary working directory is usable, and the environment is clean
    ok = run_sandboxed("import os\nopen('a.txt', 'w').write('1')\nassert open('a.txt').read() == '1'\n"
                       "assert 'PYTHONPATH' not in os.environ and os.environ['HOME'] == os.getcwd()\n")
    assert ok.passed, ok.reason


def test_network_namespace_when_available():
    r = run_sandboxed("pass\n")
    from rft_core.rewards.code import _netns_prefix

    assert r.isolation == ("namespace+audit" if _netns_prefix() else "audit")
    assert run_sandboxed("pass\n", network="audit").isolation == "audit"


def test_missing_metadata_is_a_clear_error():
    bad = RewardSample(sample_id="x1", prompt_id="p", label="humaneval", question="q", prompt_text="", response="",
                       reference="", metadata={"entry_point": "f"})
    with pytest.raises(RewardError, match=r"sample x1 has no \['test'\] in its metadata"):
        CodeExecReward(CodeExecSource()).score([bad])


def test_humaneval_dataset_bounds():
    ds = HumanEvalDataset(10)
    assert len(ds) == 10 and ds[0]["metadata"]["task_id"] == "HumanEval/0" and ds[9]["metadata"]["entry_point"]
    assert "```python\nfrom typing import List" in ds[0]["question"]
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(ValueError, match="data.size must be 1..164, got 200"):
        HumanEvalDataset(200)
