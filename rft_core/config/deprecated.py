"""Config keys renamed by issue 37 ("one place per setting"): read for one more release with a
``DeprecatedKeyWarning`` that names the new key, then removed.

The Ray cluster is set in one section, ``ray``, which the rollout fan-out and the resident
workers both read; resident workers are asked for one way, ``orchestration.workers: resident``
(``runners.<stage>`` says how a stage's own process starts under ``workers: stage``).

| old key | new key |
|---|---|
| ``orchestration.ray_address`` | ``ray.address`` |
| ``orchestration.ray_init_kwargs`` | ``ray.init_kwargs`` |
| ``orchestration.worker_options`` | ``ray.options`` |
| ``runners.<stage>.ray_address`` | ``ray.address`` |
| ``runners.<stage>.ray_init_kwargs`` | ``ray.init_kwargs`` |
| ``runners.rollout.ray_remote_options`` | ``ray.options.rollout_shard`` |
| ``runners.<stage>.mode: resident`` | ``orchestration.workers: resident`` |
| ``runners.<stage>.workers.ray_address``, ``.ray_init_kwargs``, ``.options`` | ``ray.address``, ``ray.init_kwargs``, ``ray.options`` |
| ``runners.<stage>.workers.threads``, ``.sync_timeout_s``, ``.sync_bucket_mb``, ``.policy_ranks`` | ``orchestration.worker_threads``, ``.sync_timeout_s``, ``.sync_bucket_mb``, ``.policy_ranks`` |

An old key at its old default says nothing and is dropped without a warning (a config dumped
before the rename, e.g. by ``rft replay``, carries every key). Old and new keys that now name
one setting must agree; two values are refused naming both keys.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from rft_core.config._base import _given

# old key -> (new key, the old key's default); an old key at its default is dropped silently
_RAY = {"ray_address": ("ray.address", None), "ray_init_kwargs": ("ray.init_kwargs", {})}
ORCHESTRATION_KEYS = {**_RAY, "worker_options": ("ray.options", {})}
RUNNER_KEYS = {**_RAY, "ray_remote_options": ("ray.options.rollout_shard", {})}
WORKERS_KEYS = {**_RAY, "options": ("ray.options", {}), "threads": ("orchestration.worker_threads", None),
                "sync_timeout_s": ("orchestration.sync_timeout_s", 300.0),
                "sync_bucket_mb": ("orchestration.sync_bucket_mb", 256), "policy_ranks": ("orchestration.policy_ranks", 1)}
# runners.<stage>.workers keys that are no setting any more: the run fills them in
WORKERS_FILLED_IN = {"pool": "the run root", "rollout_versions": "rollout.max_staleness",
                     "rollout_gpus": "the rollout engine's tensor_parallel_size"}
RESIDENT = "orchestration.workers"


class DeprecatedKeyWarning(FutureWarning):
    """A config key renamed by issue 37, still read this release; the message names the new key.

    A ``FutureWarning``, Python's category for deprecations meant for the end users of an
    application (the warnings module's documentation), so that ``rft train`` shows it: Python
    hides ``DeprecationWarning`` outside ``__main__``."""


def _message(old: str, new: str) -> str:
    why = ""
    if new == RESIDENT:
        new, why = f"{RESIDENT}=resident", " (every model stage then runs in its resident worker)"
    return f"{old} is deprecated (read as {new} this release, removed in the next): write {new}{why}"


def _runner_moves(stage: str, runner: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The (old key, new key, value) moves of one ``runners.<stage>`` mapping, whose old keys
    are popped from it.

    Raises:
        ValueError: ``runners.<stage>.workers`` holds a key that never was a setting.
    """
    moves = []
    for key, (new, default) in RUNNER_KEYS.items():
        if key in runner:
            value = runner.pop(key)
            if key == "ray_remote_options" and stage != "rollout":
                if value != default:
                    warnings.warn(f"runners.{stage}.ray_remote_options is deprecated and did nothing (only the rollout "
                                  "is sharded, ray.options.rollout_shard): remove it", DeprecatedKeyWarning, stacklevel=2)
            elif value != default:
                moves.append((f"runners.{stage}.{key}", new, value))
    workers = _given(runner.pop("workers", None))
    if runner.get("mode") == "resident":
        del runner["mode"]
        moves.append((f"runners.{stage}.mode=resident", RESIDENT, "resident"))
    for key, value in (workers.items() if isinstance(workers, dict) else ()):
        if key in WORKERS_FILLED_IN:
            warnings.warn(f"runners.{stage}.workers.{key} is deprecated and no setting: the run fills it in from "
                          f"{WORKERS_FILLED_IN[key]}; remove it", DeprecatedKeyWarning, stacklevel=2)
        elif key in WORKERS_KEYS:
            new, default = WORKERS_KEYS[key]
            if value != default:
                moves.append((f"runners.{stage}.workers.{key}", new, value))
        else:
            raise ValueError(f"runners.{stage}.workers.{key}: not a setting; valid keys here (deprecated: "
                             f"{', '.join(WORKERS_KEYS)}): write them in the ray and orchestration sections")
    return moves


def _apply(sections: dict[str, dict[str, Any]], moves: list[tuple[str, str, Any]]) -> None:
    """Set each new key of ``moves`` in ``sections`` (``ray``, ``orchestration``), warning once
    per old key.

    Raises:
        ValueError: the old keys of one new key, or an old key and the new key, give two values.
    """
    by_new: dict[str, list[tuple[str, Any]]] = {}
    for old, new, value in moves:
        by_new.setdefault(new, []).append((old, value))
    for new, olds in by_new.items():
        section, *parents, leaf = new.split(".")
        node = sections[section]
        for part in parents:  # ray.options.rollout_shard: a copy of the given ray.options
            node[part] = dict(node.get(part) or {})
            node = node[part]
        values = olds + ([(new, node[leaf])] if leaf in node else [])
        if any(v != values[0][1] for _, v in values[1:]):
            given = " and ".join(k if "=" in k else f"{k}={v!r}" for k, v in values)
            raise ValueError(f"{given} give {new} two values (the old keys are deprecated names of {new}): "
                             f"write {new} once")
        node[leaf] = values[0][1]
        for old, _ in olds:
            warnings.warn(_message(old, new), DeprecatedKeyWarning, stacklevel=2)


def move_renamed_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A raw training config (the mapping ``TrainConfig`` validates) with every old key of the
    table above moved to its new key, warning with ``DeprecatedKeyWarning`` for each that is
    not at its old default. Unchanged (the same object) when it holds no old key.

    Raises:
        ValueError: two values for one setting (an old and the new key, or two old keys), or an
            unknown key under ``runners.<stage>.workers``; the message names the keys.
    """
    sections = {name: _given(data.get(name)) for name in ("ray", "orchestration")}
    runners = data.get("runners")
    if not all(isinstance(s, dict) for s in sections.values()):
        return data  # validation reports the section that is not a mapping
    orchestration = sections["orchestration"]
    moves = []
    found = False
    for key, (new, default) in ORCHESTRATION_KEYS.items():
        if key in orchestration:
            found = True
            value = orchestration.pop(key)
            if value != default:
                moves.append((f"orchestration.{key}", new, value))
    new_runners = dict(runners) if isinstance(runners, Mapping) else {}
    for stage, runner in list(new_runners.items()):
        given = _given(runner)
        if not isinstance(given, dict) or not (set(given) & set(RUNNER_KEYS) or given.get("workers") is not None
                                               or given.get("mode") == "resident"):
            continue
        found = True
        moves += _runner_moves(stage, given)
        if given:
            new_runners[stage] = given
        else:  # it held old keys only
            del new_runners[stage]
    if not found:
        return data
    _apply(sections, moves)
    return {**data, **sections, **({"runners": new_runners} if isinstance(runners, Mapping) else {})}
