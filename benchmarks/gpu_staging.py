"""The page-locked staging of a CUDA optimizer state before its background write
(``rft_core.stages.optimizer_state.stage_on_host``) on a GPU: the staged copy is on the host,
page-locked, equal to the device state, and reused by the next staging; a policy's weights
staged the same way (``_staged_weights``, tied embeddings kept one tensor) save as the model's own
save does, byte for byte; and what the optimizer staging costs, in
seconds, for the AdamW state (float32 moments and masters) of ``--params`` parameters: the first
staging (page-locked allocation included) and the next ones (buffers reused).

    python benchmarks/gpu_staging.py [--params 402000000] [--repeats 3] [--json OUT]

Exit status 1 when a check fails, 2 without a CUDA device. ``benchmarks/gpu_session.sh overlap``
runs it; the CPU tests of the same function are in tests/rft_core/stages/test_optimizer_state.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from _env import ROOT  # noqa: E402,F401  (repository on sys.path, offline environment)


def _weights_checks(opt_state) -> dict[str, bool]:
    """A background policy checkpoint's weights staged on the host (``_staged_weights``): a tiny
    Llama with tied embeddings on the GPU, built from a config; its staged copy is page-locked,
    keeps the tied names one tensor, and ``save_checkpoint(state_dict=...)`` writes the files of
    the model's own save, byte for byte."""
    import hashlib
    import tempfile
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rft_core.training.checkpoint import save_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to("cuda")
    staged, reused = opt_state._staged_weights(model.state_dict())
    saver = type("NoTokenizer", (), {"save_pretrained": lambda self, out: None})()
    checks = {"weights staged in the reused buffers": reused,
              "weights on the host, page-locked": all(t.device.type == "cpu" and t.is_pinned() for t in staged.values()),
              "tied weights staged as one tensor": staged["lm_head.weight"] is staged["model.embed_tokens.weight"]}
    with tempfile.TemporaryDirectory() as tmp:  # (save_pretrained drops the tied names from the dict it is given)
        save_checkpoint(model, saver, None, f"{tmp}/own")
        save_checkpoint(model, saver, None, f"{tmp}/staged", state_dict=staged)
        files = [{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(tmp, d).iterdir())}
                 for d in ("own", "staged")]
    return {**checks, "saved from the staged copy: the model's own files": files[0] == files[1]
            and "model.safetensors" in files[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=402_000_000, help="parameters of the model whose state is staged")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from rft_core.stages import optimizer_state as opt_state

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    model = torch.nn.Linear(64, 32, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(8, 64, device="cuda")).square().sum().backward()
    opt.step()
    staged, reused = opt_state.stage_on_host(opt.state_dict())
    first = staged["state"][0]["exp_avg"]
    again, _ = opt_state.stage_on_host(opt.state_dict())
    checks = {
        "staged in the reused buffers": reused,
        "on the host, page-locked": first.device.type == "cpu" and first.is_pinned(),
        "equal to the device state": all(torch.equal(staged["state"][k][n].cpu(), v.cpu())
                                         for k, s in opt.state_dict()["state"].items() for n, v in s.items()),
        "the next staging reuses the buffers": again["state"][0]["exp_avg"].data_ptr() == first.data_ptr(),
    }
    checks.update(_weights_checks(opt_state))
    opt_state.release_host_staging()
    n = args.params // 8  # 8 tensors of moments and masters: exp_avg, exp_avg_sq, master per parameter tensor
    state = {"state": {i: {"step": torch.tensor(1.0, device="cuda"), "exp_avg": torch.randn(n, device="cuda"),
                           "exp_avg_sq": torch.rand(n, device="cuda")} for i in range(8)},
             "param_groups": [{"lr": 1e-6, "params": list(range(8))}],
             "master_weights": {f"w{i}": torch.randn(n, device="cuda") for i in range(8)}}
    gb = 3 * 8 * n * 4 / 1e9
    seconds = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt_state.stage_on_host(state)
        seconds.append(round(time.perf_counter() - t0, 3))
    res = {"gigabytes": round(gb, 2), "seconds": seconds, "checks": checks,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(json.dumps(res))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
