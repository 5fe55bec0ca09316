"""Numbers of verl's own policy losses, committed as test data for ours (issue 29).

Runs verl's ``compute_policy_loss_{cispo,geo_mean,sapo,gpg,clip_cov,kl_cov}``
(``verl/trainer/ppo/core_algos.py``) on fixed float64 inputs and writes, per case, the inputs,
verl's parameters, the scalar loss and its gradient with respect to ``log_prob``, with verl's
commit id, to ``tests/rft_core/algorithms/data/verl_policy_losses.json``.
``tests/rft_core/algorithms/test_policy_losses_2025.py`` compares our functions with them.

verl is not installed here: the script reads ``core_algos.py`` and ``verl/utils/torch_functional.py``
(its ``masked_mean``/``masked_sum``, real code) out of a git directory of verl (``fetch``
``github:volcengine/verl``), and stands in minimal stubs for the imports the policy losses do
not use (omegaconf, tensordict, ``verl.utils.device``, the config dataclasses: ``ActorConfig``
is a plain namespace carrying exactly the fields these functions read). Nothing of our code is
imported, so the numbers are verl's alone.

Cases are deterministic: ``clip_cov`` draws its tokens with ``torch.randperm`` on the global
RNG, so its cases are built so that every candidate token is chosen (checked here by running
verl under two different RNG seeds).

Usage:
    python benchmarks/verl_fixtures/make_policy_loss_fixtures.py [--verl-git-dir DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GIT_DIR = Path("/work/.mirror/volcengine+verl/repo")
DEFAULT_OUT = ROOT / "tests/rft_core/algorithms/data/verl_policy_losses.json"
D = torch.float64


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True, text=True).stdout


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


class ActorConfig(types.SimpleNamespace):
    """Stand-in for verl's ``ActorConfig``: the fields the policy losses read, and ``get`` (verl's
    ``BaseConfig.get``: the field, or ``default`` when the config has none), which the DPPO losses
    call for ``clip_ratio_c``."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class AlgoConfig(types.SimpleNamespace):
    """Stand-in for verl's ``AlgoConfig`` (only used in ``isinstance`` checks)."""


def load_verl(git_dir: Path, rev: str = "HEAD") -> types.ModuleType:
    """verl's ``core_algos`` module at commit ``rev``, imported from ``git_dir`` with stubbed dependencies."""
    tmp = Path(tempfile.mkdtemp(prefix="verl_src_"))
    for rel in ("verl/trainer/ppo/core_algos.py", "verl/utils/torch_functional.py"):
        (tmp / Path(rel).name).write_text(_git(git_dir, "show", f"{rev}:{rel}"))

    def unused(*args, **kwargs):
        raise NotImplementedError("stub: not used by the policy losses")

    _module("omegaconf", DictConfig=type("DictConfig", (), {}))
    _module("tensordict", TensorDict=type("TensorDict", (), {}))
    _module("verl").__path__ = []
    _module("verl.utils", as_torch_index=unused, group_mean_std=unused).__path__ = []
    _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    _module("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda fn: fn))
    _module("verl.trainer").__path__ = []
    _module("verl.trainer.config", AlgoConfig=AlgoConfig)
    _module("verl.workers").__path__ = []
    _module("verl.workers.config", ActorConfig=ActorConfig)
    modules = {}
    for name, file in (("verl.utils.torch_functional", "torch_functional.py"), ("verl_core_algos", "core_algos.py")):
        spec = importlib.util.spec_from_file_location(name, tmp / file)
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[name] = modules[name]
        spec.loader.exec_module(modules[name])
    sys.modules["verl.utils"].torch_functional = modules["verl.utils.torch_functional"]
    return modules["verl_core_algos"]


def actor_config(**fields: Any) -> ActorConfig:
    policy_loss = types.SimpleNamespace(**{k: fields.pop(k) for k in list(fields) if k in (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")})
    base = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, tau_pos=1.0, tau_neg=1.05,
                global_batch_info={})
    return ActorConfig(**{**base, **fields}, policy_loss=policy_loss)


def inputs(seed: int, *, B: int = 4, T: int = 7, log_ratio_scale: float = 0.3, seq_adv: bool = True,
           adv_scale: float = 1.0, with_weights: bool = False) -> dict[str, torch.Tensor]:
    """Float64 inputs: log-probs in (-4, 0), old = log-probs + noise, advantages per response
    (``seq_adv``) or per token, right-padded masks with every row non-empty."""
    g = torch.Generator().manual_seed(seed)
    lp = -4.0 * torch.rand(B, T, generator=g, dtype=D)
    old = lp + log_ratio_scale * torch.randn(B, T, generator=g, dtype=D)
    adv = adv_scale * (torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone() if seq_adv
                       else torch.randn(B, T, generator=g, dtype=D))
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    out = {"log_prob": lp, "old_log_prob": old, "advantages": adv, "response_mask": mask}
    if with_weights:
        out["rollout_is_weights"] = 0.5 + torch.rand(B, T, generator=g, dtype=D)
    return out


# name -> (verl function, our loss name), then the cases: (our kwargs, verl's config fields,
# loss_agg_mode, input options)
CASES: list[tuple[str, str, str, dict, dict, str, dict]] = [
    ("cispo_no_lower_bound", "compute_policy_loss_cispo", "cispo", {"clip_low": None, "clip_high": 0.2},
     {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}, "token-mean", {"seed": 1}),
    ("cispo_two_sided", "compute_policy_loss_cispo", "cispo", {"clip_low": 0.2, "clip_high": 0.28},
     {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, "seq-mean-token-sum", {"seed": 2, "seq_adv": False}),
    ("cispo_weights", "compute_policy_loss_cispo", "cispo", {"clip_low": None, "clip_high": 0.2},
     {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}, "token-mean", {"seed": 3, "with_weights": True}),
    ("gmpo_paper_clip", "compute_policy_loss_geo_mean", "gmpo", {"clip_low": 0.4, "clip_high": 0.4},
     {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, "seq-mean-token-mean", {"seed": 4, "log_ratio_scale": 0.5}),
    ("gmpo_narrow_clip", "compute_policy_loss_geo_mean", "gmpo", {"clip_low": 0.1, "clip_high": 0.15},
     {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}, "seq-mean-token-mean", {"seed": 5}),
    ("gmpo_token_advantages", "compute_policy_loss_geo_mean", "geo_mean", {"clip_low": 0.2, "clip_high": 0.3},
     {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3}, "seq-mean-token-mean", {"seed": 6, "seq_adv": False}),
    ("sapo_paper_taus", "compute_policy_loss_sapo", "sapo", {"tau_pos": 1.0, "tau_neg": 1.05},
     {"tau_pos": 1.0, "tau_neg": 1.05}, "seq-mean-token-mean", {"seed": 7, "log_ratio_scale": 0.6}),
    ("sapo_other_taus_weights", "compute_policy_loss_sapo", "sapo", {"tau_pos": 0.5, "tau_neg": 2.0},
     {"tau_pos": 0.5, "tau_neg": 2.0}, "seq-mean-token-mean", {"seed": 8, "seq_adv": False, "with_weights": True}),
    ("gpg_token_mean", "compute_policy_loss_gpg", "gpg", {}, {}, "token-mean", {"seed": 9}),
    ("gpg_seq_mean_token_mean_weights", "compute_policy_loss_gpg", "gpg", {}, {}, "seq-mean-token-mean",
     {"seed": 10, "seq_adv": False, "with_weights": True}),
    ("clip_cov_all_candidates", "compute_policy_loss_clip_cov", "clip_cov",
     {"clip_low": 0.2, "clip_high": 0.2, "clip_cov_ratio": 0.5, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0},
     {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 0.5, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0},
     "token-mean", {"seed": 11, "adv_scale": 2.0, "log_ratio_scale": 0.2}),
    ("clip_cov_paper_ratio_one_pick", "compute_policy_loss_clip_cov", "clip_cov",
     {"clip_low": 1.0, "clip_high": 1.0, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
     {"clip_ratio_low": 1.0, "clip_ratio_high": 1.0, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
     "token-mean", {"seed": 12, "adv_scale": 1.0}),
    ("kl_cov_tenth", "compute_policy_loss_kl_cov", "kl_cov", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0},
     {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}, "token-mean", {"seed": 13}),
    ("kl_cov_verl_coef_seq_sum", "compute_policy_loss_kl_cov", "kl_cov", {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1},
     {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}, "seq-mean-token-sum", {"seed": 14, "seq_adv": False}),
]


def run_case(core: types.ModuleType, fn_name: str, cfg: dict, agg: str, data: dict[str, torch.Tensor],
             rng_seed: int) -> tuple[float, list]:
    torch.manual_seed(rng_seed)
    lp = data["log_prob"].clone().requires_grad_(True)
    loss, _ = getattr(core, fn_name)(old_log_prob=data["old_log_prob"], log_prob=lp, advantages=data["advantages"],
                                     response_mask=data["response_mask"], loss_agg_mode=agg,
                                     config=actor_config(**cfg), rollout_is_weights=data.get("rollout_is_weights"))
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl-git-dir", type=Path, default=DEFAULT_GIT_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    core = load_verl(args.verl_git_dir)
    cases = []
    for case, fn_name, ours, our_kwargs, verl_cfg, agg, opts in CASES:
        opts = dict(opts)
        data = inputs(opts.pop("seed"), **opts)
        loss, grad = run_case(core, fn_name, verl_cfg, agg, data, rng_seed=0)
        again = run_case(core, fn_name, verl_cfg, agg, data, rng_seed=12345)
        if again != (loss, grad):
            raise RuntimeError(f"{case}: verl's result depends on the RNG (clip_cov's random pick); "
                               "choose other inputs")
        if not any(abs(x) > 0 for row in grad for x in row):
            raise RuntimeError(f"{case}: zero gradient, nothing to compare")
        cases.append({"case": case, "verl_function": fn_name, "loss": ours, "kwargs": our_kwargs,
                      "verl_config": verl_cfg, "loss_agg_mode": agg,
                      "inputs": {k: v.tolist() for k, v in data.items()}, "verl_loss": loss,
                      "verl_grad_log_prob": grad})
        print(f"{case:34s} {fn_name:32s} loss {loss:+.12f}")
    payload = {"verl_commit": _git(args.verl_git_dir, "rev-parse", "HEAD").strip(),
               "verl_file": "verl/trainer/ppo/core_algos.py",
               "generator": "benchmarks/verl_fixtures/make_policy_loss_fixtures.py",
               "torch": torch.__version__, "dtype": "float64", "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
