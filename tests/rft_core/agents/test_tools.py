"""The calculator's arithmetic and refusals, the tool-call formats, tool failures as
observations, the environment factory (names, settings, user classes from a file) and the
StepResult contract checks."""
from __future__ import annotations

import builtins
import math
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from rft_core.agents import (
    TOOL_FORMATS,
    AgentConfig,
    EnvConfigError,
    EnvError,
    EnvFactory,
    StepResult,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    load_environment_class,
)
from rft_core.agents.calculator import CalculatorEnv, CalculatorError, evaluate, format_number
from rft_core.agents.env import coerce_step_result


@pytest.mark.parametrize("expr, value", [
    ("12*34", 408),
    ("(12 + 3) * -4 ** 2", -240),  # ** binds tighter than unary minus: -(4**2) = -16
    ("-2**2", -4),
    ("(-2)**2", 4),
    ("2**3**2", 512),  # right-associative: 2**9
    ("7/2", 3.5),
    ("7//2", 3),
    ("-7 % 3", 2),  # the sign of the divisor
    ("-7 // 2", -4),  # floor
    ("2**-2", 0.25),
    ("3.5e2 + 1", 351.0),
    ("123456789 * 987654321", 121932631112635269),  # exact integers, no float rounding
    ("  +5 - - 3  ", 8),
])
def test_calculator_values(expr, value):
    got = evaluate(expr)
    assert got == value and type(got) is type(value)


def test_calculator_formatting():
    assert format_number(evaluate("1/3")) == "0.333333333333"
    assert format_number(evaluate("10/4*2")) == "5"  # integral float shown as an int
    assert format_number(evaluate("123456789 * 987654321")) == "121932631112635269"
    assert format_number(evaluate("2**0.5")) == "1.41421356237"
    assert format_number(1e20) == "1e+20"


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('echo hacked')", "function calls are not allowed"),
    ("x + 1", "names are not allowed ('x')"),
    ("().__class__", "Attribute is not allowed"),
    ("2**1000", "exponent 1000 too large (limit 100)"),
    ("9**99", "result too large"),  # 99 * log10(9) = 94.5 digits: refused before computing
    ("10**30 * 10**30", "result too large"),
    ("1e400", "result too large"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 ^ 3", "use **"),
    ("1,000 + 1", "comma"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("[1][0]", "Subscript is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "301 characters, the limit is 200"),
])
def test_calculator_refusals(expr, message):
    with pytest.raises(CalculatorError, match=None) as err:
        evaluate(expr)
    assert message in str(err.value)


def test_calculator_never_calls_eval_or_exec(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    assert evaluate("(1 + 2) * 3") == 9
    with pytest.raises(CalculatorError):
        evaluate("__import__('os')")


def test_calculator_time_is_bounded():
    t0 = time.perf_counter()
    for expr in ["9**9**9", "99999999999999999999 ** 100", "(10**30) ** 100", "(" * 100 + "1" + ")" * 100]:
        with pytest.raises(CalculatorError):
            evaluate(expr)
    assert time.perf_counter() - t0 < 0.5


def test_hermes_format():
    fmt = TOOL_FORMATS["hermes"]
    assert TOOL_FORMATS["json"] is fmt and fmt.stop_strings == ("</tool_call>",)
    text = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    assert fmt.parse(text) == ToolCall("calculator", {"expression": "1+2"})
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert fmt.parse(as_string) == ToolCall("f", {"a": 1})
    two = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert fmt.parse(two) == ToolCall("a", {})  # the first call; arguments default to {}
    assert fmt.parse("no call here, Answer: 3") is None
    for bad, why in [('<tool_call>{"name": "f",}</tool_call>', "not valid JSON"),
                     ('<tool_call>{"arguments": {}}</tool_call>', '"name": str'),
                     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be an object"),
                     ('<tool_call>{"name": "f"}', "unterminated <tool_call>")]:
        with pytest.raises(ToolCallError, match=why):
            fmt.parse(bad)


def test_tag_formats():
    assert TOOL_FORMATS["calc"].parse("so <calc> 12*3 </calc> then") == ToolCall("calculator", {"expression": "12*3"})
    assert TOOL_FORMATS["calc"].stop_strings == ("</calc>",)
    fenced = "<python>\n```python\nprint(1)\nprint(2)\n```\n</python>"
    assert TOOL_FORMATS["python"].parse(fenced) == ToolCall("python", {"code": "print(1)\nprint(2)"})
    with pytest.raises(ToolCallError, match="unterminated <calc>"):
        TOOL_FORMATS["calc"].parse("<calc>1+")


def test_calculator_env_steps():
    env = CalculatorEnv()
    assert env.stop_strings == ("</calc>",) and env.reset({"question": "q"}) is None
    r = env.step("Let me compute <calc>12*34</calc>")
    assert r == StepResult("408", None, False, {"tool_call": {"name": "calculator", "arguments": {"expression": "12*34"}}})
    r = env.step("<calc>1/0</calc>")
    assert r.observation == "error: calculator: division by zero" and r.info["error"] == "calculator: division by zero"
    assert not r.done
    assert env.step("Answer: 408") == StepResult(None, None, True, {})
    r = env.step("<calc>2+</calc")  # the stop string never came: a malformed call
    assert r.observation == "error: unterminated <calc>: no </calc> after it" and r.info["tool_call"] is None


def test_calculator_env_hermes_errors():
    env = EnvFactory("calculator", {"tool_format": "hermes"}).new()
    assert env.stop_strings == ("</tool_call>",)
    r = env.step('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert r.observation == "error: unknown tool 'search'; tools: calculator"
    r = env.step('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    assert r.observation.startswith("error: calculator: ") and "unexpected keyword argument 'expr'" in r.observation
    r = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2**200"}}</tool_call>')
    assert r.observation == "error: calculator: exponent 200 too large (limit 100)"


class _Tools(ToolEnvironment):
    tool_timeout_s = 0.2

    def __init__(self):
        super().__init__("hermes", {"boom": self.boom, "slow": self.slow, "junk": lambda: object(), "ok": lambda: {"b": 1, "a": [2]}})

    def boom(self):
        raise RuntimeError("disk on fire")

    def slow(self):
        time.sleep(2)
        return "late"


def _call(name: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'


def test_tool_failures_are_observations():
    env = _Tools()
    r = env.step(_call("boom"))
    assert r.observation == "error: boom: RuntimeError: disk on fire" and not r.done
    assert r.info == {"tool_call": {"name": "boom", "arguments": {}}, "error": "boom: RuntimeError: disk on fire"}
    r = env.step(_call("junk"))
    assert r.observation.startswith("error: junk: tool returned object") and "not text" in r.observation
    t0 = time.perf_counter()
    r = env.step(_call("slow"))
    assert time.perf_counter() - t0 < 1.5
    assert r.observation == "error: tool 'slow' timed out after 0.2 s" and r.info["error"]
    assert env.step(_call("ok")).observation == '{"a": [2], "b": 1}'


def test_factory_names_and_settings():
    with pytest.raises(EnvConfigError, match="unknown environment 'calc'; valid names: calculator, python, remote"):
        EnvFactory("calc")
    with pytest.raises(EnvConfigError, match="max_lenght"):
        EnvFactory("calculator", {"max_lenght": 5})
    with pytest.raises(EnvConfigError, match="unknown tool-call format 'xml'; valid names: calc, hermes"):
        EnvFactory("calculator", {"tool_format": "xml"})
    with pytest.raises(EnvConfigError, match="url"):
        EnvFactory("remote", {})
    with pytest.raises(ValidationError, match="unknown environment 'nope'"):
        AgentConfig(environment="nope")
    with pytest.raises(ValidationError, match="max_turn"):
        AgentConfig(max_turn=3)
    assert AgentConfig(environment="my_env.py:MyEnv").environment == "my_env.py:MyEnv"


def test_builtin_environments_resolve_from_the_leaf_registry():
    """The built-ins are registered below the config by import path (rft_core.environments);
    each path names the class the agents package defines, and the config checks a name
    without importing the agents package (no import cycle, issue 37)."""
    from rft_core.agents.python_env import PythonEnv
    from rft_core.agents.remote import RemoteEnv
    from rft_core.environments import ENVIRONMENTS

    assert ENVIRONMENTS.names() == ["calculator", "python", "remote"]
    assert [load_environment_class(n) for n in ENVIRONMENTS.names()] == [CalculatorEnv, PythonEnv, RemoteEnv]
    assert load_environment_class("rft_core.agents.calculator:CalculatorEnv") is CalculatorEnv
    code = ("import sys; from rft_core.config.agents import AgentConfig; from pydantic import ValidationError\n"
            "assert AgentConfig(environment='python').environment == 'python'\n"
            "try:\n    AgentConfig(environment='calc')\nexcept ValidationError as e:\n    print(e.errors()[0]['msg'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('rft_core.agents')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["Value error, unknown environment 'calc'; valid names: calculator, python, remote, or "
                   "'path/to/file.py:Class' / 'package.module:Class'", "[]"]


USER_ENV = '''
from pydantic import BaseModel, ConfigDict
from rft_core.agents import Environment, StepResult


class Countdown(Environment):
    """Says the number left; done (reward 1) when the model writes 'zero'."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        start: int = 3

    stop_strings = ("!",)

    def __init__(self, config):
        self.left = config.start

    def reset(self, prompt):
        return f"{prompt['question']}: {self.left}"

    def step(self, text):
        if "zero" in text:
            return StepResult(None, 1.0, True, {})
        self.left -= 1
        return StepResult(str(self.left), -0.25, False, {"tool_call": {"name": "count", "arguments": {}}})


class Bare:
    def step(self, text):
        return (text.upper(), None, True, {})


def not_a_class(text):
    return text
'''


def test_user_environment_from_a_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(USER_ENV)
    factory = EnvFactory(f"{path}:Countdown", {"start": 5})
    env = factory.new()
    assert env.stop_strings == ("!",) and env.reset({"question": "count"}) == "count: 5"
    assert env.step("go!") == StepResult("4", -0.25, False, {"tool_call": {"name": "count", "arguments": {}}})
    assert EnvFactory(f"{path}:Bare").new().step("hi") == ("HI", None, True, {})
    with pytest.raises(EnvConfigError, match="start"):
        EnvFactory(f"{path}:Countdown", {"start": "many"})
    with pytest.raises(EnvConfigError, match="declares no Config, so it takes no settings; got \\['x'\\]"):
        EnvFactory(f"{path}:Bare", {"x": 1})
    with pytest.raises(EnvConfigError, match="has no callable 'Missing'"):
        EnvFactory(f"{path}:Missing")
    with pytest.raises(EnvConfigError, match="is not a class with a step"):
        EnvFactory(f"{path}:not_a_class")
    with pytest.raises(EnvConfigError, match=f"environment '{tmp_path}/nope.py:X': file .*nope.py does not exist"):
        EnvFactory(f"{tmp_path}/nope.py:X")
    with pytest.raises(EnvConfigError, match="cannot import 'no_such_module_xyz'"):
        EnvFactory("no_such_module_xyz:Env")


def test_step_result_contract():
    assert coerce_step_result(("o", 1, False, {}), where="w") == StepResult("o", 1.0, False, {})
    assert coerce_step_result({"observation": None, "done": True}, where="w") == StepResult(None, None, True, {})
    for bad, why in [("text", "step returned str"), (StepResult(5), "observation is int"),
                     (StepResult("o", "high"), "reward is 'high'"), (StepResult("o", math.nan), "reward is nan"),
                     (StepResult("o", True), "reward is True"), (StepResult("o", None, "yes"), "done is 'yes'"),
                     (StepResult("o", None, False, []), "info is list")]:
        with pytest.raises(EnvError, match=f"w: {why}"):
            coerce_step_result(bad, where="w")


def test_the_docs_example_environment_runs(tmp_path):
    """The complete example class of docs/agents.md, taken from the page and run."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "agents.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if b.startswith("# my_env.py")]
    (tmp_path / "my_env.py").write_text(code)
    env = EnvFactory(f"{tmp_path / 'my_env.py'}:Guess", {"high": 1000}).new()
    assert env.reset({"answer": "42"}) == "I am thinking of a number between 1 and 1000."
    call = '<tool_call>{{"name": "guess", "arguments": {{"n": {}}}}}</tool_call>'
    assert [env.step(call.format(n)).observation for n in (50, 10, 42)] == ["lower", "higher", "correct"]
    r = env.step(call.format('"x"'))
    assert r.observation == "error: guess: n must be an integer, got 'x'" and not r.done
    assert env.step("Answer: 42") == StepResult(None, 1.0, True, {})
    assert env.step("Answer: 41") == StepResult(None, 0.0, True, {})
