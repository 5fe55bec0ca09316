"""Numbers of verl's own functions for the objectives of issue 38, committed as test data for ours.

Runs, on fixed float64 inputs (verl commit 1dda039b unless said otherwise):

- ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` (``verl/trainer/ppo/core_algos.py``): loss,
  gradient with respect to ``log_prob`` and the masked fraction (``actor/pg_clipfrac``);
- ``compute_rollout_correction_and_rejection_mask`` (``verl/trainer/ppo/rollout_corr_helper.py``):
  sequence-level truncated IS weights (``rollout_is="sequence"``), the k1/k3 rejection masks
  (``rollout_rs``), and a token TIS + k3 rejection combination;
- ``compute_rollout_importance_weights(rollout_is_level="geometric", rollout_is_mode="truncate")``
  of ``verl/trainer/ppo/mismatch_helper.py`` at verl commit 4bf4bd32, the last commit with the
  geometric-mean IS weight (verl then kept the geometric mean for rejection only);
- ``compute_optimal_token_baseline_advantage`` (``handle_zero_tail`` default, True since PR #5380)
  and ``compute_multi_turn_optimal_token_baseline_advantage`` on multi-turn masks;
- ``compute_gpg_outcome_advantage`` and ``compute_gdpo_outcome_advantage`` (per-source scores
  through ``algorithm.gdpo_reward_keys`` / ``gdpo_reward_weights``, as verl's trainer passes them);
- ``kl_penalty(..., "abs+")``, value and gradient;

and writes inputs, outputs and the commit ids to ``tests/rft_core/algorithms/data/verl_objectives.json``,
which ``tests/rft_core/algorithms/test_dppo.py``, ``test_correction_verl.py`` and
``test_estimators_2026.py`` compare our functions with.

verl is not installed here: like ``make_policy_loss_fixtures.py`` (whose loader and stand-ins this
script reuses), it reads the source files out of a git directory of verl (``fetch``
``github:verl-project/verl``), with the real ``verl/utils/torch_functional.py`` of the same commit,
and stands in minimal stubs for imports these functions do not call (``verl.protocol.DataProto``:
``from_dict(tensors=...)`` keeping the tensors in ``.batch``, what the functions use it for; the
config dataclasses). Nothing of our code is imported, so the numbers are verl's alone.

Usage:
    python benchmarks/verl_fixtures/make_objective_fixtures.py [--verl-git-dir DIR] [--rev REV]
        [--geometric-rev REV] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_policy_loss_fixtures import _git, _module, actor_config, load_verl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GIT_DIR = Path("/work/.mirror/verl-project+verl/repo")
DEFAULT_REV = "1dda039b9"  # verl-project/verl, the commit issue 38 names
GEOMETRIC_REV = "4bf4bd32d"  # the parent of 418f964ab: mismatch_helper.py with rollout_is_level="geometric"
DEFAULT_OUT = ROOT / "tests/rft_core/algorithms/data/verl_objectives.json"
D = torch.float64


class DataProto:
    """Stand-in for ``verl.protocol.DataProto``: ``from_dict(tensors=...)`` keeps the tensors in ``batch``."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor], **_: Any) -> "DataProto":
        return cls(dict(tensors))


def _exec(name: str, source: str) -> types.ModuleType:
    path = Path(tempfile.mkdtemp(prefix="verl_src_")) / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_helpers(git_dir: Path, rev: str, geometric_rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """verl's ``rollout_corr_helper`` at ``rev`` and ``mismatch_helper`` at ``geometric_rev``, each
    with the ``torch_functional`` of its own commit (``load_verl`` must have run: it stubs the rest)."""
    _module("verl.protocol", DataProto=DataProto)
    _module("verl.trainer.config.algorithm", RolloutCorrectionConfig=type("RolloutCorrectionConfig", (), {}))
    _module("verl.workers.config.actor", PolicyLossConfig=type("PolicyLossConfig", (), {}))
    helpers = []
    for r, rel in ((rev, "verl/trainer/ppo/rollout_corr_helper.py"), (geometric_rev, "verl/trainer/ppo/mismatch_helper.py")):
        tf = _exec(f"verl_tf_{r}", _git(git_dir, "show", f"{r}:verl/utils/torch_functional.py"))
        sys.modules["verl.utils.torch_functional"] = tf
        sys.modules["verl.utils"].torch_functional = tf  # type: ignore[attr-defined]
        helpers.append(_exec(f"verl_{Path(rel).stem}_{r}", _git(git_dir, "show", f"{r}:{rel}")))
    return helpers[0], helpers[1]


def _lists(x: torch.Tensor) -> Any:
    return x.tolist()


def _rows(lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=D)


# ------------------------------------------------------------------------------------ DPPO
def dppo_inputs(seed: int, *, B: int = 5, T: int = 8, log_ratio_scale: float = 0.4, seq_adv: bool = True,
                with_weights: bool = False) -> dict[str, torch.Tensor]:
    """Float64 inputs whose log-probs are log-probabilities (DPPO compares probabilities): mu in
    (0.02, 0.95), pi = min(mu * exp(noise), 0.99); advantages per response or per token of both
    signs; right-padded masks with every row non-empty."""
    g = torch.Generator().manual_seed(seed)
    mu = 0.02 + 0.93 * torch.rand(B, T, generator=g, dtype=D)
    pi = (mu * torch.exp(log_ratio_scale * torch.randn(B, T, generator=g, dtype=D))).clamp(max=0.99)
    adv = (torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone() if seq_adv
           else torch.randn(B, T, generator=g, dtype=D))
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    out = {"log_prob": pi.log(), "old_log_prob": mu.log(), "advantages": adv, "response_mask": mask}
    if with_weights:
        out["rollout_is_weights"] = 0.5 + torch.rand(B, T, generator=g, dtype=D)
    return out


# (case, verl function, our loss, our kwargs, verl actor fields, loss_agg_mode, input options)
DPPO_CASES: list[tuple[str, str, str, dict, dict, str, dict]] = [
    ("dppo_tv_default_threshold", "compute_policy_loss_dppo_tv", "dppo_tv", {"clip_low": 0.15, "clip_high": 0.15},
     {"clip_ratio": 0.15, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 1e4}, "token-mean",
     {"seed": 21, "seq_adv": False, "log_ratio_scale": 0.4}),
    ("dppo_tv_asymmetric_weights", "compute_policy_loss_dppo_tv", "dppo_tv", {"clip_low": 0.05, "clip_high": 0.25},
     {"clip_ratio_low": 0.05, "clip_ratio_high": 0.25, "clip_ratio_c": 1e4}, "seq-mean-token-mean",
     {"seed": 22, "seq_adv": False, "with_weights": True, "log_ratio_scale": 0.5}),
    ("dppo_tv_ratio_cap", "compute_policy_loss_dppo_tv", "dppo_tv", {"clip_low": 0.2, "clip_high": 0.2, "ratio_cap": 1.3},
     {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 1.3}, "token-mean",
     {"seed": 23, "seq_adv": False, "log_ratio_scale": 0.5}),
    ("dppo_kl_default_threshold", "compute_policy_loss_dppo_kl", "dppo_kl", {"clip_low": 0.05, "clip_high": 0.05},
     {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 1e4}, "token-mean",
     {"seed": 24, "seq_adv": False, "log_ratio_scale": 0.5}),
    ("dppo_kl_asymmetric_cap_weights", "compute_policy_loss_dppo_kl", "dppo_kl",
     {"clip_low": 0.02, "clip_high": 0.08, "ratio_cap": 1.4},
     {"clip_ratio_low": 0.02, "clip_ratio_high": 0.08, "clip_ratio_c": 1.4}, "seq-mean-token-sum",
     {"seed": 25, "seq_adv": False, "with_weights": True, "log_ratio_scale": 0.6}),
]


def dppo_cases(core: types.ModuleType) -> list[dict]:
    out = []
    for case, fn, ours, kwargs, verl_cfg, agg, opts in DPPO_CASES:
        opts = dict(opts)
        data = dppo_inputs(opts.pop("seed"), **opts)
        lp = data["log_prob"].clone().requires_grad_(True)
        loss, metrics = getattr(core, fn)(old_log_prob=data["old_log_prob"], log_prob=lp, advantages=data["advantages"],
                                          response_mask=data["response_mask"], loss_agg_mode=agg,
                                          config=actor_config(**verl_cfg), rollout_is_weights=data.get("rollout_is_weights"))
        (grad,) = torch.autograd.grad(loss, lp)
        frac = metrics["actor/pg_clipfrac"]
        if not 0 < frac < 1:
            raise RuntimeError(f"{case}: masked fraction {frac}: choose inputs where the trust region drops some tokens")
        out.append({"case": case, "verl_function": fn, "loss": ours, "kwargs": kwargs, "verl_config": verl_cfg,
                    "loss_agg_mode": agg, "inputs": {k: _lists(v) for k, v in data.items()},
                    "verl_loss": float(loss.detach()), "verl_grad_log_prob": _lists(grad), "verl_masked_frac": frac})
        print(f"{case:34s} loss {float(loss.detach()):+.12f} masked {frac:.3f}")
    return out


# ------------------------------------------------------------------------ rollout correction
def _correction_inputs(seed: int, scale: float, B: int = 6, T: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rollout = -3.0 * torch.rand(B, T, generator=g, dtype=D)
    old = rollout + scale * torch.randn(B, T, generator=g, dtype=D)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    return {"old_log_prob": old, "rollout_log_prob": rollout, "response_mask": mask}


# (case, verl rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, seed, scale, our kwargs)
CORRECTION_CASES: list[tuple[str, str | None, Any, str | None, Any, int, float, dict]] = [
    ("seq_tis", "sequence", 2.0, None, None, 31, 0.25, {"mode": "seq-tis", "cap": 2.0}),
    ("seq_tis_tight_cap", "sequence", 1.2, None, None, 32, 0.2, {"mode": "seq-tis", "cap": 1.2}),
    ("token_k1_asymmetric", None, None, "token_k1", "0.7_1.6", 33, 0.4,
     {"mode": "none", "rejection": "token_k1", "rejection_low": 1 / 1.6, "rejection_cap": 1 / 0.7}),
    ("token_k1_reciprocal", None, None, "token_k1", 1.5, 34, 0.4,
     {"mode": "none", "rejection": "token_k1", "rejection_cap": 1.5}),
    ("seq_sum_k1", None, None, "seq_sum_k1", "0.5_1.8", 35, 0.3,
     {"mode": "none", "rejection": "seq_sum_k1", "rejection_low": 1 / 1.8, "rejection_cap": 1 / 0.5}),
    ("seq_mean_k1", None, None, "seq_mean_k1", "0.9_1.05", 36, 0.3,
     {"mode": "none", "rejection": "seq_mean_k1", "rejection_low": 1 / 1.05, "rejection_cap": 1 / 0.9}),
    ("token_k3", None, None, "token_k3", 0.05, 37, 0.4, {"mode": "none", "rejection": "token_k3", "rejection_cap": 0.05}),
    ("seq_sum_k3", None, None, "seq_sum_k3", 0.2, 38, 0.3, {"mode": "none", "rejection": "seq_sum_k3", "rejection_cap": 0.2}),
    ("seq_mean_k3", None, None, "seq_mean_k3", 0.04, 39, 0.3,
     {"mode": "none", "rejection": "seq_mean_k3", "rejection_cap": 0.04}),
    ("seq_max_k3", None, None, "seq_max_k3", 0.12, 40, 0.3, {"mode": "none", "rejection": "seq_max_k3", "rejection_cap": 0.12}),
    ("token_tis_with_seq_mean_k3", "token", 1.5, "seq_mean_k3", 0.04, 41, 0.3,
     {"mode": "tis", "cap": 1.5, "rejection": "seq_mean_k3", "rejection_cap": 0.04}),
]


def correction_cases(helper: types.ModuleType) -> list[dict]:
    out = []
    for case, is_level, is_thr, rs, rs_thr, seed, scale, ours in CORRECTION_CASES:
        data = _correction_inputs(seed, scale)
        weights, mask, _ = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=data["old_log_prob"], rollout_log_prob=data["rollout_log_prob"],
            response_mask=data["response_mask"], rollout_is=is_level, rollout_is_threshold=is_thr,
            rollout_rs=rs, rollout_rs_threshold=rs_thr)
        w = weights.batch["rollout_is_weights"] if weights is not None else None
        kept = mask.sum() / data["response_mask"].sum()
        if rs is not None and not 0 < float(kept) < 1:
            raise RuntimeError(f"{case}: rejection keeps {float(kept):.3f} of the tokens: choose other inputs")
        if w is not None and not bool((w[data["response_mask"] > 0] >= is_thr).any()):
            raise RuntimeError(f"{case}: no weight reaches the cap: choose other inputs")
        out.append({"case": case, "rollout_is": is_level, "rollout_is_threshold": is_thr, "rollout_rs": rs,
                    "rollout_rs_threshold": rs_thr, "ours": ours, "inputs": {k: _lists(v) for k, v in data.items()},
                    "verl_weights": None if w is None else _lists(w), "verl_mask": _lists(mask)})
        print(f"{case:30s} kept {float(kept):.3f}")
    return out


def geometric_cases(mismatch: types.ModuleType) -> list[dict]:
    out = []
    for case, seed, scale, cap in (("geo_tis", 42, 0.4, 1.1), ("geo_tis_wide_cap", 43, 0.3, 2.0)):
        data = _correction_inputs(seed, scale)
        weights, mask, _ = mismatch.compute_rollout_importance_weights(
            old_log_prob=data["old_log_prob"], rollout_log_prob=data["rollout_log_prob"],
            response_mask=data["response_mask"], rollout_is_level="geometric", rollout_is_mode="truncate",
            rollout_is_threshold=cap)
        w = weights.batch["rollout_is_weights"]
        out.append({"case": case, "rollout_is_level": "geometric", "rollout_is_mode": "truncate",
                    "rollout_is_threshold": cap, "ours": {"mode": "geo-tis", "cap": cap},
                    "inputs": {k: _lists(v) for k, v in data.items()}, "verl_weights": _lists(w),
                    "verl_mask": _lists(mask)})
        print(f"{case:30s} capped rows {int((w[:, 0] >= cap).sum())}")
    return out


# ----------------------------------------------------------------------------- estimators
def _outcome(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The score on the last unmasked token of each row (works for multi-turn masks too)."""
    out = torch.zeros_like(mask)
    T = mask.shape[1]
    last = (mask * torch.arange(T, dtype=D)).argmax(-1)
    out[torch.arange(len(scores)), last] = scores
    return out


def _policy_stats(g: torch.Generator, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(B, T, 5, generator=g, dtype=D) * 1.5
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs.view(-1, 5), 1, generator=g).view(B, T)
    return probs.gather(-1, tokens[..., None]).squeeze(-1).log(), (probs**2).sum(-1)


def otb_cases(core: types.ModuleType) -> list[dict]:
    g = torch.Generator().manual_seed(51)
    out = []
    groups = ["a", "a", "a", "b", "b", "c", "c", "c", "c", "d"]
    scores = torch.tensor([1, 0, 1, 0, 1, 1, 0, 0, 1, 1], dtype=D)
    T = 9
    single = _rows([4, 2, 7, 3, 3, 1, 6, 2, 6, 3], T)  # a: 7 unique longest; b: tie; c: tie at 6
    # multi-turn rows: observation tokens (0) inside the response
    multi = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 1, 1, 1],
                          [1, 1, 0, 1, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0],
                          [0, 0, 1, 1, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=D)
    old_lp, spi2 = _policy_stats(g, len(groups), T)
    is_w = (0.5 + torch.rand(len(groups), T, generator=g, dtype=D)).round(decimals=3)
    for name, fn, mask, zero_tail, weights in (
        ("single_turn_zero_tail", "compute_optimal_token_baseline_advantage", single, True, None),
        ("single_turn_zero_tail_is_weights", "compute_optimal_token_baseline_advantage", single, True, is_w),
        ("single_turn_no_zero_tail", "compute_optimal_token_baseline_advantage", single, False, None),
        ("multi_turn_zero_tail", "compute_multi_turn_optimal_token_baseline_advantage", multi, True, None),
        ("multi_turn_no_zero_tail_is_weights", "compute_multi_turn_optimal_token_baseline_advantage", multi, False, is_w),
        ("single_turn_function_on_multi_turn_rows", "compute_optimal_token_baseline_advantage", multi, True, None),
    ):
        adv, ret = getattr(core, fn)(token_level_rewards=_outcome(scores, mask), response_mask=mask,
                                     index=np.array(groups, dtype=object), old_log_probs=old_lp, sum_pi_squared=spi2,
                                     rollout_is_weights=weights, handle_zero_tail=zero_tail)
        out.append({"case": name, "verl_function": fn, "rewards": _lists(scores), "group": groups, "mask": _lists(mask),
                    "old_logprobs": _lists(old_lp), "sum_pi_squared": _lists(spi2), "handle_zero_tail": zero_tail,
                    "rollout_is_weights": None if weights is None else _lists(weights), "advantages": _lists(adv),
                    "returns": _lists(ret)})
    return out


def gpg_cases(core: types.ModuleType) -> list[dict]:
    out = []
    for name, rewards, groups in (
        # the zero rewards are exactly the flat groups': verl's alpha = B / nnz is the paper's B / (B - M)
        ("zeros_are_the_flat_groups", [1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.75, 1.0, 0.25, 0.0, 0.0, 0.0],
         ["a", "a", "a", "b", "b", "b", "c", "c", "c", "d", "d", "d"]),
        # binary rewards, flat groups b (all 1) and c (all 0), a group of one (e): verl's alpha = B / (correct
        # samples) = 17 / 9, the paper's B / (B - M) = 17 / 8; verl's group of one has mean 0 (A = alpha r)
        ("binary_rewards", [1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1],
         ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 4 + ["e"]),
    ):
        r = torch.tensor(rewards, dtype=D)
        mask = _rows([3] * len(rewards), 3)
        adv, _ = core.compute_gpg_outcome_advantage(token_level_rewards=_outcome(r, mask), response_mask=mask,
                                                    index=np.array(groups, dtype=object))
        out.append({"case": name, "rewards": _lists(r), "group": groups, "advantages": _lists(adv[:, 0])})
    return out


class _AlgoConfig(dict):
    """``algorithm`` config as verl's trainer passes it to the estimators: a mapping with ``get``."""


def gdpo_cases(core: types.ModuleType) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(61)
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["d"] * 3
    lengths = [5, 2, 7, 3, 4, 4, 1, 6, 2, 3, 7, 5, 5, 2]
    B, T, P = len(groups), 8, 3
    mask = _rows(lengths, T)
    scores = {"correctness": torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0], dtype=D),
              "format": (torch.rand(B, generator=g, dtype=D) * 4).round() / 4,  # float32-exact quarters
              "length": torch.tensor([0.5, 1, 0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25, 0.75, 0, 0.5, 0.5, 1], dtype=D)}
    for name, keys, weights in (("three_sources_weighted", ["correctness", "format", "length"], [1.0, 0.5, 0.25]),
                                ("two_sources_default_weights", ["correctness", "format"], None)):
        cfg = _AlgoConfig(gdpo_reward_keys=keys, **({"gdpo_reward_weights": weights} if weights else {}))
        batch = {"prompts": torch.zeros(B, P, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1)}
        combined = sum(scores[k] for k in keys)
        adv, _ = core.compute_gdpo_outcome_advantage(
            token_level_rewards=_outcome(combined, mask), response_mask=mask, index=np.array(groups, dtype=object),
            config=cfg, non_tensor_batch={k: scores[k].numpy() for k in keys}, batch=batch)
        out.append({"case": name, "group": groups, "lengths": lengths, "T": T,
                    "scores": {k: _lists(scores[k]) for k in keys}, "weights": weights, "advantages": _lists(adv),
                    "dtype": str(adv.dtype)})
    return out


def abs_plus_cases(core: types.ModuleType) -> list[dict]:
    log_ratio = torch.tensor([[0.7, -0.3, 2.5, -4.0, 9.5], [-9.0, 0.05, -0.6, 3.3, 1e-3]], dtype=D)
    ref = torch.log(torch.tensor([[0.3, 0.2, 0.05, 0.4, 1e-4], [0.25, 0.5, 0.1, 0.01, 0.6]], dtype=D))
    logprob = (ref + log_ratio).requires_grad_(True)
    value = core.kl_penalty(logprob, ref, "abs+")
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    return [{"logprobs": _lists(logprob.detach()), "ref_logprobs": _lists(ref), "value": _lists(value.detach()),
             "grad": _lists(grad)}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl-git-dir", type=Path, default=DEFAULT_GIT_DIR)
    ap.add_argument("--rev", default=DEFAULT_REV)
    ap.add_argument("--geometric-rev", default=GEOMETRIC_REV)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    core = load_verl(args.verl_git_dir, args.rev)
    corr, mismatch = load_helpers(args.verl_git_dir, args.rev, args.geometric_rev)
    full = _git(args.verl_git_dir, "rev-parse", args.rev).strip()
    data = {
        "verl_commit": full,
        "verl_geometric_commit": _git(args.verl_git_dir, "rev-parse", args.geometric_rev).strip(),
        "verl_files": ["verl/trainer/ppo/core_algos.py", "verl/trainer/ppo/rollout_corr_helper.py",
                       "verl/trainer/ppo/mismatch_helper.py (verl_geometric_commit)"],
        "generator": "benchmarks/verl_fixtures/make_objective_fixtures.py",
        "torch": torch.__version__, "dtype": "float64 (gdpo: verl casts the per-source scores to float32)",
        "dppo": dppo_cases(core),
        "rollout_correction": correction_cases(corr),
        "geometric_is": geometric_cases(mismatch),
        "optimal_token_baseline": otb_cases(core),
        "gpg": gpg_cases(core),
        "gdpo": gdpo_cases(core),
        "abs_plus_kl": abs_plus_cases(core),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out} (verl {full[:8]}, geometric IS {data['verl_geometric_commit'][:8]})")


if __name__ == "__main__":
    main()
