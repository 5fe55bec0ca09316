#!/usr/bin/env bash
# The GPU checks of issues 44, 45 and 47 in one call on a lent GPU machine (no network, no Prefect, no Ray):
# what docs/gpu.md "GPU run of 2026-11-28" records. Everything it needs travels with the repository:
#   .whl/   pydantic (+ core, typing-inspection, annotated-types), TRL 1.16 + datasets + dill + multiprocess, xxhash,
#           deepspeed's sdist (built here with DS_BUILD_OPS=0) and what it imports (einops, hjson, msgpack,
#           ninja, psutil, py-cpuinfo)
#   .carry/tok/   the default model's tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja)
#   .carry/default/   an RFT_CACHE_DIR with the default model's tokenizer and config, no weights (for the tests)
# `make gpu-kit` assembles both here (benchmarks/gpu_kit.py); the device call carries them: carry [".whl", ".carry"].
# Each part has its own time limit and writes its log and JSON under $OUT (default: ./gpu-out), most important first.
#   bash benchmarks/gpu_session.sh bench      # on the GPU machine, from the repository root: issue 44 (~7 min)
#   bash benchmarks/gpu_session.sh checks     # issues 45 and 47, and issue 44 again after fixes (~6 min)
#   bash benchmarks/gpu_session.sh again      # the workers' tests with the tokenizer, then the whole bench (~5 min)
#   bash benchmarks/gpu_session.sh resident   # the resident arm alone, 4 steps (~2 min)
#   bash benchmarks/gpu_session.sh memo       # the whole bench with stage mode keeping its models, and its test on CUDA (~7 min)
#   bash benchmarks/gpu_session.sh overlap    # the whole bench after the update trains during the optimizer write,
#                                             # then the staging's checks, the optimizer tests and the stage arm with
#                                             # checkpoint.async_weights=false (the weights written by the update), profiled (~10 min)
#   bash benchmarks/gpu_session.sh every      # the whole bench, then the stage arm with checkpoint.every=4 (stage mode
#                                             # keeping the policy between checkpoints), the checksums' rates, the
#                                             # staging's checks and the optimizer tests (~6 min; limits 570 s in all)
set -u
PART=${1:-bench}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=1
SITE=/tmp/site-packages
[ -d "$SITE/pydantic" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    > "$OUT/install.log" 2>&1 || echo "wheel install failed" >> "$OUT/install.log"
if [ "$PART" = checks ] && [ ! -d "$SITE/deepspeed" ] && ls .whl/deepspeed-*.tar.gz > /dev/null 2>&1; then
    DS_BUILD_OPS=0 timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" \
        .whl/deepspeed-*.tar.gz >> "$OUT/install.log" 2>&1 || echo "deepspeed build failed" >> "$OUT/install.log"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ [ "$PART" = bench ] || [ "$PART" = overlap ] || [ "$PART" = every ]; } && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c \
  "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
TOK=.carry/tok
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? $((SECONDS - t0)) s" >> "$OUT/steps.txt"
}
if [ "$PART" = every ]; then
# issue 44: the whole table (TRL, resident, stage with a checkpoint every step, the default), then the stage arm with
# checkpoint.every=4 (2026-11-30: the updates between checkpoints write no weights and no AdamW state, the kept trainer
# serves the next stages; --rebuild-probe: the policy of step 3 rebuilt as a resume would, whether the re-applied updates
# give the recorded digests on the GPU), then the pinned-memory staging's checks and the optimizer-state tests
step bench_gpu 330 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --json "$OUT/bench_gpu.json" \
    --doc "$OUT/benchmarks_gpu.md"
step stage_every4 120 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --arms stage --steps 4 \
    --set checkpoint.every=4 --rebuild-probe --json "$OUT/bench_stage_every4.json"
# the GPU host's own rates for a 0.4B checkpoint's file checksums (manifest v2: XXH3-128, against sha256 before)
step checksums 30 python3 benchmarks/checksums.py --repeats 1 --json "$OUT/checksums.json"
step staging_cuda 45 python3 benchmarks/gpu_staging.py --json "$OUT/gpu_staging.json"
step optimizer_state_cuda 45 env RFT_CACHE_DIR="$PWD/.carry/default" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/rft_core/stages/test_optimizer_state.py --timeout 40
elif [ "$PART" = overlap ]; then
# issue 44: the whole table after the next update learned to train during the optimizer-state write (staged in
# page-locked host memory first); then the staging's checks and cost on the GPU (benchmarks/gpu_staging.py) and the
# optimizer-state tests on the GPU machine
step bench_gpu 330 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --json "$OUT/bench_gpu.json" \
    --doc "$OUT/benchmarks_gpu.md"
step staging_cuda 60 python3 benchmarks/gpu_staging.py --json "$OUT/gpu_staging.json"
step optimizer_state_cuda 90 env RFT_CACHE_DIR="$PWD/.carry/default" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/rft_core/stages/test_optimizer_state.py --timeout 80
# the table's stage arm writes its weights in the background (checkpoint.async_weights, the default: the update commits
# their digest, the writer thread the weights after the optimizer stage, both from pinned host copies); this one has the
# update write them itself (async_weights=false, the layout before 2026-11-29), so the two measure the option; with a
# cProfile of steps 2-4 (where stage mode's own update seconds go)
step stage_sync_weights 120 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --arms stage --steps 4 \
    --set checkpoint.async_weights=false --profile "$OUT/prof" --json "$OUT/bench_stage_sync_weights.json"
elif [ "$PART" = memo ]; then
# issue 44: the whole table (TRL, resident, stage) with stage mode keeping its models (orchestration.keep_models)
step bench_gpu 330 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --json "$OUT/bench_gpu.json" \
    --doc "$OUT/benchmarks_gpu.md"
# the kept models' bit-equality test on CUDA (tiny models with the default model's tokenizer)
step memo_cuda 90 env RFT_CACHE_DIR="$PWD/.carry/default" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/rft_core/stages/test_stage_memo.py --timeout 80
elif [ "$PART" = resident ]; then
# issue 44: the resident arm alone, 4 steps (step 4 writes its checkpoint in the background)
step bench_resident 150 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --arms resident --steps 4 \
    --json "$OUT/bench_resident.json"
elif [ "$PART" = again ]; then
# issue 45: the resident workers' tests on CUDA; .carry/default holds the default model's tokenizer and config
# (no weights: the tests build tiny models with its tokenizer), so the tests find no GGUF to convert
step workers_cuda 110 env RFT_CACHE_DIR="$PWD/.carry/default" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/rft_core/workers --timeout 100
# issue 44: the whole table again (TRL, resident, stage) after the fixes, in one run
step bench_gpu 330 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --json "$OUT/bench_gpu.json" \
    --doc "$OUT/benchmarks_gpu.md"
elif [ "$PART" = bench ]; then
# issue 44: ours (resident, stage) against TRL, the Qwen2.5-0.5B shape, bf16
step bench_gpu 330 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --json "$OUT/bench_gpu.json" \
    --doc "$OUT/benchmarks_gpu.md"
# issue 44 item 5: the HF engine's decode in float32 and bfloat16, cache kept or emptied, profiled
step decode_profile 100 python3 benchmarks/decode_profile.py --tokenizer "$TOK" --json "$OUT/decode_profile.json"
else
# issue 45: the resident workers' tests on CUDA (Ray is absent here: its tests skip)
step workers_cuda 110 python3 -m pytest -q -p no:cacheprovider -rs tests/rft_core/workers --timeout 100
# issue 47: one FSDP2 update against DeepSpeed ZeRO-3 on this GPU, the same 0.4B shape
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_bench import build_model; from pathlib import Path; \
build_model('qwen0.5b', 0, '$TOK', Path('/tmp/q05'))" >> "$OUT/install.log" 2>&1
step fsdp_gpu 90 python3 benchmarks/fsdp_gpu.py --model /tmp/q05 --json "$OUT/fsdp_gpu.json"
# issue 44 item 5: the bfloat16 decode again, cuDNN attention off (configure_cuda_backends)
step decode_bf16 45 python3 benchmarks/decode_profile.py --tokenizer "$TOK" --dtypes bfloat16 --repeats 2
# issue 44: the resident arm again, after the fixes of the first call's findings
step resident_again 80 python3 benchmarks/gpu_bench.py --tokenizer "$TOK" --arms resident --steps 3 \
    --json "$OUT/bench_resident.json"
fi
cat "$OUT/steps.txt"
