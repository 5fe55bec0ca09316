"""User reward functions, named as ``package.module:function`` or ``path/to/file.py:function``.

Three calling conventions (the source's ``call``):

- ``sample``: ``fn(sample: RewardSample) -> float | (float, reason) | dict`` once per sample; a
  dict may hold ``score`` (required), ``correct``, ``reason`` and further numbers (``extras``).
- ``batch``: ``fn(samples: list[RewardSample]) -> list`` of the same per-sample values.
- ``lightrft``: ``fn(queries, prompts, labels) -> list[float]`` (LightRFT's custom reward
  function: queries = prompt + response, labels = the recipe labels).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rft_core.rewards.base import RewardError, RewardSample, SourceScore


def load_function(spec: str, *, kind: str = "reward function") -> Callable[..., Any]:
    """Import ``module:function`` or ``file.py:function`` (a relative file is taken from the
    current directory); ``kind`` names what it is in error messages ("reward function",
    "environment", ...).

    Raises:
        RewardError: the module or file cannot be imported, or has no such callable; the
            message names the spec.
    """
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardError(f"{kind} {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise RewardError(f"{kind} {spec!r}: file {path} does not exist")
            name = f"rft_user_reward_{abs(hash(str(path)))}"
            module = sys.modules.get(name)
            if module is None:
                mod_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(mod_spec)
                mod_spec.loader.exec_module(module)
                sys.modules[name] = module
        else:
            module = importlib.import_module(target)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"{kind} {spec!r}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"{kind} {spec!r}: {target!r} has no callable {attr!r}")
    return fn


def source_fingerprint(spec: str) -> str:
    """sha256 (hex) of the source file that defines the function ``spec`` names, so that editing
    a user reward function changes the rewards stage's config hash (a committed rewards shard is
    then reported stale instead of silently reused).

    Only the defining file is hashed, not the modules it imports.

    Raises:
        RewardError: the function cannot be imported (``load_function``), or its module has no
            readable source file (a builtin or extension module).
    """
    fn = load_function(spec)
    try:
        path = inspect.getsourcefile(inspect.unwrap(fn)) or inspect.getsourcefile(sys.modules[fn.__module__])
    except (TypeError, KeyError):
        path = None
    if not path or not Path(path).is_file():
        raise RewardError(f"reward function {spec!r}: no Python source file to fingerprint")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def code_fingerprints(cfg) -> dict[str, str]:
    """{spec: sha256 of its source file} for every user function a reward config calls: the
    ``python`` sources and a ``module:function`` aggregation. Empty when it calls none.

    Args:
        cfg: ``rft_core.config.RewardConfig``.
    Raises:
        RewardError: as ``source_fingerprint``.
    """
    specs = [src.function for src in cfg.sources.values() if getattr(src, "type", None) == "python"]
    if cfg.aggregation != "weighted_sum":
        specs.append(cfg.aggregation)
    return {spec: source_fingerprint(spec) for spec in sorted(set(specs))}


def to_source_score(value: Any, *, where: str) -> SourceScore:
    """Turn what a user function returned for one sample into a ``SourceScore``.

    Raises:
        RewardError: not a number, a (number, reason) pair or a dict with ``score``.
    """
    if isinstance(value, SourceScore):
        return value
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{where}: returned a dict without 'score': {value!r}")
        extras = {k: float(v) for k, v in value.items() if k not in ("score", "correct", "reason", "extracted")}
        return SourceScore(_number(value["score"], where), value.get("correct"), value.get("extracted"),
                           value.get("reason"), extras)
    if isinstance(value, tuple) and len(value) == 2:
        return SourceScore(_number(value[0], where), reason=None if value[1] is None else str(value[1]))
    return SourceScore(_number(value, where))


def _number(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) and not hasattr(x, "__float__"):
        raise RewardError(f"{where}: returned {x!r}, not a number")
    return float(x)


class PythonReward:
    """Source ``python``: the user's function (conventions in the module docstring). The
    function is imported when the source is built, so a bad spec fails before any scoring."""

    def __init__(self, cfg, name: str = "python") -> None:
        self.cfg, self.name = cfg, name
        self.fn = load_function(cfg.function)

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]:
        where = f"reward source {self.name!r} ({self.cfg.function})"
        if self.cfg.call == "sample":
            out = []
            for s in samples:
                try:
                    value = self.fn(s)
                except Exception as exc:  # noqa: BLE001 - per-sample failure; the engine applies on_error
                    out.append(SourceScore(float("nan"), error=f"{type(exc).__name__}: {exc}"))
                    continue
                out.append(to_source_score(value, where=f"{where} on {s.sample_id}"))
            return out
        if self.cfg.call == "batch":
            values = self.fn(list(samples))
        else:
            values = self.fn([s.prompt_text + s.response for s in samples], [s.prompt_text for s in samples],
                             [s.label for s in samples])
        values = list(values)
        if len(values) != len(samples):
            raise RewardError(f"{where}: got {len(samples)} samples, returned {len(values)} scores")
        return [to_source_score(v, where=f"{where} on {s.sample_id}") for v, s in zip(values, samples)]
