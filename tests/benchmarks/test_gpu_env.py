"""The GPU environment check (benchmarks/gpu_env.py, ``make check-gpu-deps``) on pip report
excerpts: the versions it reads and what it refuses. The resolver itself runs only in the make
target (network, minutes); these pin how its answer is judged, and that the extras and the
constraints it resolves are the ones ``make install-gpu`` installs."""
from __future__ import annotations

import re

from benchmarks.gpu_env import EXTRAS, REQUIRED, ROOT, problems, resolved_versions


def _report(**versions: str) -> dict:
    # pip's installation report, format version 1 (pip >= 22.2): one entry per distribution to install
    return {"version": "1", "install": [{"metadata": {"name": n, "version": v}} for n, v in versions.items()]}


FULL = {"vllm": "0.33.0", "torch": "2.14.0", "deepspeed": "0.19.8", "ray": "2.60.0", "prefect_ray": "0.6.0",
        "Prefect": "3.7.7", "fastapi": "0.136.3", "transformers": "5.20.2", "peft": "0.21.2"}


def test_names_are_normalised_and_a_full_resolution_passes():
    versions = resolved_versions(_report(**FULL))
    assert versions["prefect-ray"] == "0.6.0" and versions["prefect"] == "3.7.7"
    assert problems(versions, "gpu") == []


def test_a_missing_engine_or_library_is_reported():
    versions = resolved_versions(_report(**{k: v for k, v in FULL.items() if k not in ("vllm", "deepspeed")}))
    assert problems(versions, "gpu") == ["vllm is not in the resolution", "deepspeed is not in the resolution"]
    assert "sglang is not in the resolution" in problems(resolved_versions(_report(**FULL)), "gpu-sglang")


def test_a_cpu_torch_is_refused():
    versions = resolved_versions(_report(**{**FULL, "torch": "2.14.0+cpu"}))
    assert problems(versions, "gpu") == ["torch 2.14.0+cpu is a CPU build (an index or --find-links with CPU wheels "
                                         "is configured)"]


def test_the_checked_extras_are_the_installed_ones():
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11; the project supports 3.10)
    for extra, engine in EXTRAS.items():
        line = re.search(rf"^{extra} = \[(.*)\]$", pyproject, re.M)
        assert line, f"no extra {extra!r} in pyproject.toml"
        names = {re.split(r"[<>=\[]", r.strip().strip('"'))[0] for r in line.group(1).split(",")}
        assert {engine, "deepspeed", "ray", "prefect-ray"} <= names, (extra, names)
    pins = {line.split("==")[0] for line in (ROOT / "constraints-gpu.txt").read_text().splitlines() if "==" in line}
    assert set(EXTRAS.values()) <= pins  # each engine pinned: pip would otherwise backtrack it, not Prefect
    assert "torch" in REQUIRED
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints-gpu.txt -e '.[$(GPU_EXTRA)]'" in makefile and "gpu_env.py check" in makefile
