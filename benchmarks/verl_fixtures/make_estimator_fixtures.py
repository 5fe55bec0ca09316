"""Numbers of the upstream advantage estimators and KL estimator, committed as test data for ours
(issue 29).

Runs, on fixed float64 inputs:

- verl's ``compute_opo_outcome_advantage``, ``compute_remax_outcome_advantage``,
  ``compute_optimal_token_baseline_advantage`` and ``kl_penalty(..., "abs")`` (value and gradient
  with respect to ``logprob``) from ``verl/trainer/ppo/core_algos.py``;
- the Pass@k Training authors' ``compute_advantage`` / ``calc_adv`` (``code/passk_adv.py`` of
  github.com/RUCAIBox/Passk_Training; verl has no such estimator),

and writes the inputs, the outputs and both commit ids to
``tests/rft_core/algorithms/data/verl_estimators.json``, which
``tests/rft_core/algorithms/test_estimators_2025.py`` compares our functions with.

Neither project is installed here: the script reads the two source files out of git directories
(the ``fetch`` tool's ``github:volcengine/verl`` and ``github:RUCAIBox/Passk_Training``) and puts
minimal stubs in place of the imports these functions do not use (omegaconf, the verl config
dataclasses, ``verl.utils``; none of the functions run here calls them). Nothing of our code is
imported, so the numbers are upstream's alone.

Usage:
    python benchmarks/verl_fixtures/make_estimator_fixtures.py [--verl-git-dir DIR] [--passk-git-dir DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
VERL_GIT_DIR = Path("/work/.mirror/volcengine+verl/repo")
PASSK_GIT_DIR = Path("/work/.mirror/RUCAIBox+Passk_Training/repo")
DEFAULT_OUT = ROOT / "tests/rft_core/algorithms/data/verl_estimators.json"
D = torch.float64


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True, text=True).stdout


def _import_source(name: str, source: str) -> types.ModuleType:
    path = Path(tempfile.mkdtemp(prefix="upstream_")) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stub(name: str, package: bool = False, **attrs: Any) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if package:
        mod.__path__ = []  # type: ignore[attr-defined]
    sys.modules[name] = mod


def load_verl_core_algos(git_dir: Path) -> types.ModuleType:
    """verl's ``core_algos`` from ``git_dir`` (HEAD), its unused imports stubbed."""
    def not_here(*args, **kwargs):
        raise NotImplementedError("stub: not called by the functions this script runs")

    _stub("omegaconf", DictConfig=type("DictConfig", (), {}))
    _stub("verl", package=True)
    _stub("verl.utils", package=True, as_torch_index=not_here, group_mean_std=not_here)
    _stub("verl.utils.torch_functional", masked_whiten=not_here, masked_mean=not_here, masked_sum=not_here)
    _stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda fn: fn))
    _stub("verl.trainer", package=True)
    _stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    _stub("verl.workers", package=True)
    _stub("verl.workers.config", ActorConfig=type("ActorConfig", (), {}))
    sys.modules["verl.utils"].torch_functional = sys.modules["verl.utils.torch_functional"]  # type: ignore[attr-defined]
    return _import_source("verl_core_algos", _git(git_dir, "show", "HEAD:verl/trainer/ppo/core_algos.py"))


def load_passk(git_dir: Path) -> types.ModuleType:
    """The Pass@k Training authors' ``code/passk_adv.py`` from ``git_dir`` (HEAD)."""
    return _import_source("passk_adv", _git(git_dir, "show", "HEAD:code/passk_adv.py"))


def _rows(lengths: list[int], T: int) -> torch.Tensor:
    """(B, T) float64 right-padded response mask."""
    return torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=D)


def _outcome(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards: the score on the last unmasked token."""
    out = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    out[torch.arange(len(scores)), last] = scores
    return out


def _lists(x: torch.Tensor) -> Any:
    return x.tolist()


def opo_cases(core) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    cases = []
    for groups, lengths in ((["a", "a", "a", "b", "b", "b", "b", "c", "c"], [3, 1, 5, 2, 2, 4, 6, 5, 1]),
                            (["p", "q", "p", "q", "p", "q"], [4, 2, 1, 6, 3, 5])):
        T = max(lengths) + 1
        mask = _rows(lengths, T)
        scores = torch.rand(len(groups), generator=g, dtype=D).round(decimals=3)
        scores[::3] = torch.tensor([0.0, 1.0, 1.0], dtype=D)[: len(scores[::3])]
        tlr = _outcome(scores, mask)
        adv, ret = core.compute_opo_outcome_advantage(token_level_rewards=tlr.clone(), response_mask=mask,
                                                      index=np.array(groups, dtype=object))
        cases.append({"rewards": _lists(scores), "group": groups, "lengths": lengths, "T": T,
                      "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def remax_cases(core) -> list[dict]:
    g = torch.Generator().manual_seed(12)
    cases = []
    for lengths, kl_coef in (([3, 1, 4, 2, 5], 0.0), ([2, 5, 3, 4], 0.1)):
        T = max(lengths) + 2
        mask = _rows(lengths, T)
        scores = torch.rand(len(lengths), generator=g, dtype=D).round(decimals=3)
        per_token = torch.rand(len(lengths), T, generator=g, dtype=D).round(decimals=3) * mask
        tlr = _outcome(scores, mask) - kl_coef * per_token  # token rewards with a per-token penalty
        baselines = torch.rand(len(lengths), generator=g, dtype=D).round(decimals=3)
        adv, ret = core.compute_remax_outcome_advantage(token_level_rewards=tlr, reward_baselines=baselines,
                                                        response_mask=mask)
        cases.append({"rewards": _lists(scores), "token_rewards": _lists(tlr), "reward_baselines": _lists(baselines),
                      "lengths": lengths, "T": T, "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def otb_cases(core) -> list[dict]:
    g = torch.Generator().manual_seed(13)
    cases = []
    groups = ["a", "a", "a", "b", "b", "c", "c", "c", "c", "d"]  # d: one sample (baseline 0)
    lengths = [4, 2, 6, 3, 3, 1, 5, 2, 6, 3]
    T = 7
    mask = _rows(lengths, T)
    V = 5
    logits = torch.randn(len(groups), T, V, generator=g, dtype=D) * 1.5
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs.view(-1, V), 1, generator=g).view(len(groups), T)
    old_log_probs = probs.gather(-1, tokens[..., None]).squeeze(-1).log()
    sum_pi_squared = (probs**2).sum(-1)
    scores = torch.tensor([1, 0, 1, 0, 1, 1, 0, 0, 1, 1], dtype=D)
    tlr = _outcome(scores, mask)
    is_weights = (0.5 + torch.rand(len(groups), T, generator=g, dtype=D)).round(decimals=3)
    for weights in (None, is_weights):
        adv, ret = core.compute_optimal_token_baseline_advantage(
            token_level_rewards=tlr, response_mask=mask, index=np.array(groups, dtype=object),
            old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared, rollout_is_weights=weights)
        cases.append({"rewards": _lists(scores), "group": groups, "lengths": lengths, "T": T,
                      "old_logprobs": _lists(old_log_probs), "sum_pi_squared": _lists(sum_pi_squared),
                      "rollout_is_weights": None if weights is None else _lists(weights),
                      "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def abs_kl_cases(core) -> list[dict]:
    log_ratio = torch.tensor([[0.7, -0.3, 2.5, -4.0, 9.5], [-9.0, 0.05, -0.6, 3.3, 1e-3]], dtype=D)
    ref = torch.log(torch.tensor([[0.3, 0.2, 0.05, 0.4, 1e-4], [0.25, 0.5, 0.1, 0.01, 0.6]], dtype=D))
    logprob = (ref + log_ratio).requires_grad_(True)
    value = core.kl_penalty(logprob, ref, "abs")
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    return [{"logprobs": _lists(logprob.detach()), "ref_logprobs": _lists(ref), "value": _lists(value.detach()),
             "grad": _lists(grad)}]


def pass_at_k_cases(passk) -> list[dict]:
    cases = []
    for rewards, groups, k in (
        ([1, 0, 0, 0], ["a"] * 4, 2),  # the hand case: n=4, c=1, k=2
        ([1, 0, 1, 0, 0, 1, 0, 0] + [0, 0, 0, 0, 0] + [1, 1, 1, 1, 1] + [1, 0, 1, 1],
         ["a"] * 8 + ["b"] * 5 + ["c"] * 5 + ["d"] * 4, 3),
        ([0, 1, 1, 0, 0, 0] + [1, 0, 0, 0, 0, 0], ["x"] * 6 + ["y"] * 6, 1),
        ([1, 0, 0, 1, 0, 0, 0, 1] + [0, 1, 0, 0, 0, 0, 0, 0], ["p"] * 8 + ["q"] * 8, 4),
    ):
        scores = torch.tensor(rewards, dtype=D)
        mask = torch.ones(len(rewards), 2, dtype=D)
        tlr = torch.zeros_like(mask)
        tlr[:, -1] = scores
        with contextlib.redirect_stdout(io.StringIO()):  # passk_adv.compute_advantage prints the group rows
            adv, _ = passk.compute_advantage(tlr, mask, np.array(groups, dtype=object), k)
        cases.append({"rewards": rewards, "group": groups, "k": k, "advantages": _lists(adv[:, 0])})
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl-git-dir", type=Path, default=VERL_GIT_DIR)
    ap.add_argument("--passk-git-dir", type=Path, default=PASSK_GIT_DIR)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_default_dtype(D)
    core = load_verl_core_algos(args.verl_git_dir)
    passk = load_passk(args.passk_git_dir)
    data = {
        "verl_commit": _git(args.verl_git_dir, "rev-parse", "HEAD").strip(),
        "verl_file": "verl/trainer/ppo/core_algos.py",
        "passk_commit": _git(args.passk_git_dir, "rev-parse", "HEAD").strip(),
        "passk_file": "code/passk_adv.py (github.com/RUCAIBox/Passk_Training)",
        "generator": "benchmarks/verl_fixtures/make_estimator_fixtures.py",
        "opo": opo_cases(core),
        "remax": remax_cases(core),
        "optimal_token_baseline": otb_cases(core),
        "abs_kl": abs_kl_cases(core),
        "pass_at_k": pass_at_k_cases(passk),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out} (verl {data['verl_commit'][:8]}, Passk_Training {data['passk_commit'][:8]})")


if __name__ == "__main__":
    main()
