"""Screenshot of a finished training run's artifacts in the Prefect UI -> docs/prefect_ui_artifacts.png.

A one-off documentation asset, not a test: it brings up the local stack (`flows.serve`: a server
on a free port with a throw-away PREFECT_HOME, the `local` pool, `prefect deploy --all`, a
worker), runs the `rft-train-preset/grpo-demo` deployment (the default model, 3 iterations
unless told otherwise), then photographs four UI pages with headless Chromium
(`apt-get install chromium`) and tiles them 2 x 2:

    the training flow run's Artifacts tab | the metrics-curve artifact (embedded PNG)
    the last iteration's samples table    | the training-metrics table

    .venv/bin/python benchmarks/ui_screenshot.py [--iterations 3] [--set key=value ...] [--run-root DIR] [--keep]

Prints the time the run took and where the image is. ``--run-root`` of an earlier run resumes it
(its committed stages are reused, the artifacts are published again). ``--keep`` leaves the
stack running to browse it (Ctrl-C stops it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoot(chromium: str, url: str, out: Path, size: tuple[int, int] = (1400, 900)) -> Path:
    """Headless Chromium screenshot of ``url`` (waits for the single-page app to render)."""
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=15000", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=120)
    return out


def tile(images: list[Path], out: Path, crop: tuple[int, int, int, int], cols: int = 2) -> Path:
    """Crop every image to ``crop`` (left, top, right, bottom) and tile them row by row."""
    from PIL import Image

    tiles = [Image.open(p).convert("RGB").crop(crop) for p in images]
    w, h = tiles[0].size
    rows = (len(tiles) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * w + (cols - 1) * 8, rows * h + (rows - 1) * 8), "white")
    for i, t in enumerate(tiles):
        sheet.paste(t, ((i % cols) * (w + 8), (i // cols) * (h + 8)))
    sheet.save(out, optimize=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=3, help="training iterations of the photographed run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra dotted override key=value")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "prefect_ui_artifacts.png", help="image to write")
    ap.add_argument("--run-root", type=Path, default=None, help="run folder (default: a new temp folder)")
    ap.add_argument("--keep", action="store_true", help="leave the stack running after the screenshot")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        sys.exit("error: no chromium on PATH (apt-get install -y chromium)")

    work = Path(tempfile.mkdtemp(prefix="rft-ui-shot-"))
    os.environ.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false")
    os.environ.pop("PREFECT_API_URL", None)
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    import yaml

    from flows.serve import start_stack

    overrides = {"iterations": args.iterations, "run_root": str(args.run_root or work / "run")}
    for item in args.overrides:  # flat dotted keys, as the deployment's `overrides` parameter takes them
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"error: --set {item!r} must look like key.sub=value")
        overrides[key.strip()] = yaml.safe_load(value)
    def _interrupt(*_):  # SIGTERM (e.g. from `timeout`) stops the stack like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    stack = start_stack("127.0.0.1", _free_port(), poll_seconds=1, log_dir=work / "logs")
    try:
        with SyncPrefectClient(api=stack.api_url) as client:
            dep = client.read_deployment_by_name("rft-train-preset/grpo-demo")
            fr = client.create_flow_run_from_deployment(dep.id, parameters={"overrides": overrides})
            t0 = time.time()
            while not (fr := client.read_flow_run(fr.id)).state.is_final():
                time.sleep(2)
            print(f"flow run {fr.name}: {fr.state.name} in {time.time() - t0:.0f} s")
            if not fr.state.is_completed():
                sys.exit(f"error: the training run ended {fr.state.name}: {fr.state.message}")
            keys = ["metrics-curve", f"samples-iter-{args.iterations:06d}", "training-metrics"]
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
            latest = {}
            for a in sorted(arts, key=lambda a: a.created):
                latest[a.key] = a
        ui = f"{stack.ui_url}/v2"
        train_run = latest["training-metrics"].flow_run_id
        shots = [shoot(chromium, f"{ui}/runs/flow-run/{train_run}?tab=Artifacts", work / "0.png"),
                 shoot(chromium, f"{ui}/artifacts/artifact/{latest['metrics-curve'].id}", work / "1.png"),
                 shoot(chromium, f"{ui}/artifacts/artifact/{latest[keys[1]].id}", work / "2.png"),
                 shoot(chromium, f"{ui}/artifacts/artifact/{latest['training-metrics'].id}", work / "3.png")]
        out = tile(shots, args.out, crop=(250, 0, 1400, 760))
        print(json.dumps({"image": str(out), "bytes": out.stat().st_size, "ui": stack.ui_url, "work": str(work)}))
        if args.keep:
            print(f"browse {stack.ui_url}; Ctrl-C stops the stack")
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
