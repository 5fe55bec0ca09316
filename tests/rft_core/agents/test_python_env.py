"""The python environment runs the model's code in the code_exec sandbox: output, exceptions,
timeouts and refusals come back as observations."""
from __future__ import annotations

import shutil
import time

import pytest

from rft_core.agents import EnvFactory, StepResult
from rft_core.agents.python_env import run_program, truncate

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")


def test_stdout_comes_back():
    env = EnvFactory("python", {}).new()
    assert env.stop_strings == ("</python>",)
    r = env.step("Let me check. <python>\nx = 2**10\nprint(x, x + 1)\n</python>")
    assert r == StepResult("1024 1025\n", None, False, {"tool_call": {"name": "python", "arguments": {"code": "x = 2**10\nprint(x, x + 1)"}}})
    assert env.step("<python>x = 1</python>").observation == "(no output)"
    r = env.step("<python>import sys\nprint('out')\nprint('warn', file=sys.stderr)</python>")
    assert r.observation == "out\n\nstderr:\nwarn" and "error" not in r.info


def test_an_exception_is_an_error_observation_after_the_output():
    env = EnvFactory("python", {}).new()
    r = env.step("<python>print('before')\n1/0</python>")
    assert r.observation == "before\nerror: ZeroDivisionError: division by zero"
    assert r.info["error"] == "ZeroDivisionError: division by zero" and not r.done
    r = env.step("<python>def f(:\n  pass</python>")
    assert r.observation.startswith("error: SyntaxError")


def test_a_timeout_is_an_error_observation():
    env = EnvFactory("python", {"timeout_s": 1}).new()
    t0 = time.perf_counter()
    r = env.step("<python>print('start', flush=True)\nwhile True: pass</python>")
    assert time.perf_counter() - t0 < 5
    assert r.observation == "start\nerror: timeout after 1 s" and r.info["error"] == "timeout after 1 s"


def test_the_sandbox_refuses_network_and_files_outside():
    out = run_program("import socket\nsocket.socket()")
    assert not out.ok and out.reason == "sandbox: socket.__new__ is not allowed"
    out = run_program("open('/etc/passwd').read()")
    assert not out.ok and "sandbox: open '/etc/passwd' for reading is not allowed" in out.reason


def test_long_output_is_truncated():
    env = EnvFactory("python", {"max_output_chars": 50}).new()
    r = env.step("<python>print('x' * 200)</python>")
    assert r.observation == "x" * 50 + "\n... [151 more characters truncated]"  # 200 x's and the newline
    assert truncate("abc", 3) == "abc"
