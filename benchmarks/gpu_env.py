"""The GPU environment (issue 36): does it still resolve, and what is installed.

``check`` (``make check-gpu-deps``): pip's resolver in a dry run (``pip install --dry-run
--ignore-installed --report``: package metadata only, no wheel is downloaded or installed) for
each GPU extra of pyproject.toml with constraints-gpu.txt, as ``make install-gpu`` installs them:
``gpu`` (vLLM) and ``gpu-sglang`` (SGLang), each with DeepSpeed, Ray, prefect-ray and Prefect in
one environment. Exit code 1, with pip's own explanation, when an extra no longer resolves
(e.g. an engine pins a fastapi that the Prefect floor excludes), or when a resolution lacks one
of the packages the environment is for or would bring a CPU build of torch. Runs on any machine
with PyPI access (the CPU machines here included); a few minutes, most of it fetching metadata.

``show`` (the last step of ``make install-gpu``): the versions in the current environment and
what torch sees (CUDA, NCCL, GPUs).

    python benchmarks/gpu_env.py check [--extra gpu] [--json out.json]
    python benchmarks/gpu_env.py show
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"gpu": "vllm", "gpu-sglang": "sglang"}  # extra -> its engine
# one torch for trainer and engine, and the rest of the stack the GPU environment is for
REQUIRED = ("torch", "deepspeed", "ray", "prefect-ray", "prefect", "fastapi", "transformers", "peft")
SHOWN = ("vllm", "sglang", "torch", *REQUIRED[1:], "pydantic", "starlette", "flashinfer-python",
         "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def resolved_versions(report: dict) -> dict[str, str]:
    """{normalised distribution name: version} of a ``pip install --report`` JSON (report format
    version 1: ``install[].metadata.name/version``)."""
    return {_norm(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def problems(versions: dict[str, str], extra: str) -> list[str]:
    """What makes a resolution of ``extra`` unusable on a GPU node: a missing engine or
    required package, a torch CPU build (local version ``+cpu``)."""
    out = [f"{name} is not in the resolution" for name in (EXTRAS[extra], *REQUIRED) if name not in versions]
    torch = versions.get("torch", "")
    if "+cpu" in torch:
        out.append(f"torch {torch} is a CPU build (an index or --find-links with CPU wheels is configured)")
    return out


def resolve(extra: str, *, constraints: Path, python: str = sys.executable) -> dict[str, str]:
    """Dry-run resolve ``prefect-rft[extra]`` with ``constraints``; returns the resolved versions.

    Raises:
        RuntimeError: pip found no resolution (its output's tail in the message) or failed otherwise.
    """
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
               "-c", str(constraints), f"{ROOT}[{extra}]"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not report.exists():
            lines = [x for x in (proc.stdout + proc.stderr).splitlines() if not x.startswith("WARNING: Location")]
            raise RuntimeError(f"prefect-rft[{extra}] does not resolve with {constraints.name} "
                               f"(pip exit {proc.returncode}):\n" + "\n".join(lines[-40:]))
        return resolved_versions(json.loads(report.read_text()))


def check(extras: list[str], constraints: Path, json_out: Path | None) -> int:
    """``check``: resolve every extra, print the versions that matter; 0 when all are usable."""
    failed, results = False, {}
    for extra in extras:
        try:
            versions = resolve(extra, constraints=constraints)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            failed = True
            continue
        bad = problems(versions, extra)
        failed |= bool(bad)
        results[extra] = {k: versions[k] for k in SHOWN if k in versions}
        print(f"prefect-rft[{extra}]: {len(versions)} distributions, " + ("OK" if not bad else "; ".join(bad)))
        print("  " + ", ".join(f"{k} {v}" for k, v in results[extra].items()))
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed else 0


def show() -> int:
    """``show``: this environment's versions and torch's view of the GPUs."""
    for name in SHOWN:
        try:
            print(f"{name:18} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    import torch

    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    print(f"torch CUDA {torch.version.cuda}, NCCL {nccl}, GPUs visible: {torch.cuda.device_count() if cuda else 0}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="dry-run resolve the GPU extras (pip, no install)")
    c.add_argument("--extra", action="append", choices=sorted(EXTRAS), help="default: all")
    c.add_argument("--constraints", type=Path, default=ROOT / "constraints-gpu.txt")
    c.add_argument("--json", type=Path, help="write the resolved versions here")
    sub.add_parser("show", help="versions installed here, CUDA and NCCL as torch sees them")
    args = p.parse_args(argv)
    if args.cmd == "check":
        return check(args.extra or list(EXTRAS), args.constraints, args.json)
    return show()


if __name__ == "__main__":
    sys.exit(main())
