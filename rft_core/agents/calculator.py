"""The ``calculator`` environment: safe arithmetic on the model's tool calls.

Model text is never given to ``eval``/``exec``: the expression is parsed with Python's ``ast``
(``mode="eval"``) and walked here, allowing only int/float literals, the binary operators
+ - * / // % ** , unary + and -, and parentheses (which ``ast`` resolves into the tree). Names,
calls, attributes, subscripts, comparisons, strings, ``^`` and everything else are refused with
an error observation. Limits keep every operation cheap: the expression's length, the exponent
of ``**`` (and the estimated size of its result, checked before computing it), and the
magnitude of every intermediate result (so a product never has more than twice the digits of
the limit).
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rft_core.config._base import _check_name
from rft_core.agents.tools import TOOL_FORMATS, ToolEnvironment


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_ALLOWED = "numbers, + - * / // % ** and parentheses"


def evaluate(expression: str, *, max_length: int = 200, max_exponent: float = 100, max_abs: float = 1e30) -> int | float:
    """The value of an arithmetic expression (Python semantics: ``/`` is true division, ``//``
    floor division, ``%`` the sign of the divisor, ``**`` right-associative; ``-2**2 == -4``).

    Args:
        expression: the text, e.g. ``"(12 + 3) * -4 ** 2"``.
        max_length: longest expression in characters (after stripping whitespace at the ends).
        max_exponent: largest ``|b|`` of ``a ** b``.
        max_abs: largest ``|value|`` of any literal or intermediate result.
    Returns:
        int when every operation stayed in the integers (``/`` always gives a float), else float.
    Raises:
        CalculatorError: empty or too long, not parseable, disallowed syntax (naming it), an
            exponent or result over the limits, division by zero, or a complex result.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be text, got {type(expression).__name__}")
    expr = expression.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > max_length:
        raise CalculatorError(f"expression has {len(expr)} characters, the limit is {max_length}")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalculatorError(f"not an arithmetic expression ({type(exc).__name__}): {expr[:80]!r}") from None
    return _Evaluator(max_exponent, max_abs).eval(tree.body)


class _Evaluator:
    def __init__(self, max_exponent: float, max_abs: float) -> None:
        self.max_exponent, self.max_abs = max_exponent, max_abs

    def eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {v!r:.40}")
            return self._checked(v)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self.eval(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(a, b)
            try:
                result = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError(f"result too large (limit {self.max_abs:g})") from None
            return self._checked(result)
        raise CalculatorError(_refusal(node))

    def _check_power(self, a: float, b: float) -> None:
        if abs(b) > self.max_exponent:
            raise CalculatorError(f"exponent {b:g} too large (limit {self.max_exponent:g})")
        if abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > math.log10(self.max_abs) + 1:
            raise CalculatorError(f"result too large (limit {self.max_abs:g})")

    def _checked(self, v: complex) -> int | float:
        if isinstance(v, complex):
            raise CalculatorError("result is not a real number")
        if isinstance(v, float) and not math.isfinite(v) or abs(v) > self.max_abs:
            raise CalculatorError(f"result too large (limit {self.max_abs:g})")
        return v


def _refusal(node: ast.AST) -> str:
    """Why ``node`` is not allowed, in words the model can act on."""
    if isinstance(node, ast.Name):
        return f"names are not allowed ({node.id!r}); only {_ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; only {_ALLOWED}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "'^' is not a power here; use **"
    if isinstance(node, ast.Tuple):
        return "a comma is not allowed (write numbers without thousands separators)"
    return f"{type(node).__name__} is not allowed; only {_ALLOWED}"


def format_number(value: float) -> str:
    """The observation text of a result: ints in full, integral floats below 1e15 as ints,
    other floats with 12 significant digits (``1/3`` -> ``0.333333333333``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorConfig(BaseModel):
    """Settings of the ``calculator`` environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_format: str = Field("calc", description="a TOOL_FORMATS name: calc (<calc>12*34</calc>) or hermes "
                             '(<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>)')
    max_length: int = Field(200, gt=0, description="longest expression (characters)")
    max_exponent: float = Field(100, gt=0, description="largest |b| in a ** b")
    max_abs: float = Field(1e30, gt=0, description="largest |value| of a literal or intermediate result")

    _format = field_validator("tool_format")(lambda cls, v: _check_name(TOOL_FORMATS, v))


class CalculatorEnv(ToolEnvironment):
    """Answers each ``calculator`` call with the expression's value (``format_number``) or an
    ``error: ...`` observation (``evaluate``'s refusals); a turn without a call ends the
    trajectory with no environment reward (the reward stage grades the final answer)."""

    Config = CalculatorConfig

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        self.config = config or CalculatorConfig()
        super().__init__(self.config.tool_format, {"calculator": self.calculate})

    def calculate(self, expression: str) -> str:
        """Tool ``calculator(expression)``. Raises: CalculatorError (reported as an observation)."""
        c = self.config
        return format_number(evaluate(expression, max_length=c.max_length, max_exponent=c.max_exponent, max_abs=c.max_abs))
