"""Assemble what ``benchmarks/gpu_session.sh`` needs on a lent GPU machine, which has no network
and neither pydantic, TRL nor DeepSpeed (the device tool's KINDS.md): run it here, then carry the
two folders with the device call (``carry: [".whl", ".carry"]``).

- ``.whl/``: wheels for the device's Python 3.12 on manylinux x86_64, downloaded by pip (no
  dependency resolution: the device holds the rest), at the versions this checkout's ``.venv``
  has installed: pydantic (+ pydantic-core, typing-inspection, annotated-types), TRL, datasets,
  dill, multiprocess, xxhash, and DeepSpeed's sdist with what it imports (hjson, einops, msgpack,
  ninja, psutil, py-cpuinfo); ``gpu_session.sh`` installs them under a path containing
  ``site-packages`` (datasets' dill hashing needs it) and builds DeepSpeed with ``DS_BUILD_OPS=0``.
- ``.carry/tok/``: the default model's tokenizer files (``gpu_bench.py --tokenizer``: the policy
  itself is built there from a config and a seed).
- ``.carry/default/``: an ``RFT_CACHE_DIR`` whose default model folder has the tokenizer and the
  config but no weights (the tests build tiny models with its tokenizer and find no GGUF to
  convert: ``rft_core.models.hub`` takes a folder with ``config.json`` as converted).

    make gpu-kit            # = .venv/bin/python benchmarks/gpu_kit.py (~1 min, ~20 MB)

Exit status 1 (with pip's message) when a download fails, or when the kit exceeds the 64 MiB a
device call carries.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from _env import ROOT

# distributions the device lacks or holds at other versions (docs/gpu.md, "GPU run of 2026-11-28"): wheels, sdists
WHEELS = ["pydantic", "pydantic-core", "typing-inspection", "annotated-types", "trl", "datasets", "dill", "multiprocess",
          "xxhash", "hjson", "einops", "msgpack", "ninja", "psutil", "py-cpuinfo"]
SDISTS = ["deepspeed"]
DEVICE_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]
CONFIG_FILES = ["config.json", "generation_config.json"]
CARRY_LIMIT = 64 * 2**20  # what one device call carries, the working tree included


def pinned(names: list[str]) -> list[str]:
    """``name==version`` of each distribution as installed in this environment.

    Raises:
        SystemExit: one is not installed (named; ``make install`` and ``pip install -e '.[bench]'``
            install them).
    """
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_kit: {name} is not installed in {sys.prefix}: the kit carries the versions installed "
                             "here (make install; TRL: pip install -e '.[bench]')") from None
    return out


def download(specs: list[str], dest: Path, *, binary: bool) -> None:
    """``pip download`` ``specs`` into ``dest`` without their dependencies: wheels built for the
    device's Python and platform (``binary``), else source distributions."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    else:
        cmd += ["--no-binary=:all:"]
    subprocess.run(cmd + specs, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the default model's converted folder (default: converted now)")
    args = ap.parse_args()
    from rft_core.models.hub import ensure_default_model

    model = Path(args.model) if args.model else ensure_default_model()
    whl, carry = ROOT / ".whl", ROOT / ".carry"
    shutil.rmtree(whl, ignore_errors=True)
    shutil.rmtree(carry, ignore_errors=True)
    whl.mkdir()
    try:
        download(pinned(WHEELS), whl, binary=True)
        download(pinned(SDISTS), whl, binary=False)
    except subprocess.CalledProcessError as exc:
        print(f"gpu_kit: pip download failed ({exc})", file=sys.stderr)
        return 1
    tok, default = carry / "tok", carry / "default" / "models" / model.name
    for folder, names in ((tok, TOKENIZER_FILES), (default, TOKENIZER_FILES + CONFIG_FILES)):
        folder.mkdir(parents=True)
        for name in names:
            if (model / name).exists():
                shutil.copy2(model / name, folder / name)
    if not (tok / "tokenizer.json").exists() or not (default / "config.json").exists():
        print(f"gpu_kit: {model} holds no tokenizer.json or config.json", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for d in (whl, carry) for f in d.rglob("*") if f.is_file())
    for f in sorted(whl.iterdir()):
        print(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.relative_to(ROOT)}")
    print(f"kit: {size / 2**20:.1f} MiB in .whl/ and .carry/ (a device call carries {CARRY_LIMIT // 2**20} MiB, "
          "the working tree included)")
    return 0 if size < CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
