#!/usr/bin/env bash
# Issue 40's GPU work in one go, without Ray (docs/training.md, "Fine-tuning a trained drafter"):
#   1. the off-policy drafter: the demo's training prompts with ShareGPT's own replies (another
#      model's text; the target's states captured over them), trained from scratch like the base
#   2. on-policy data: the target regenerates the first N demo training prompts, and the
#      simulated users' prompts (the sweep's held-out set, never trained on nor benchmarked)
#   3. the fine-tuning sweep from both drafters on that data (benchmarks/finetune_sweep.py)
# Inputs: T (the target's GGUF), P (benchmarks/demo_prompts.py's folder), W (work dir).
#   T=/tmp/t.gguf P=.carry/prompts W=/tmp/w setsid bash scripts/gpu_drafters.sh &   # $W/progress
set -uo pipefail
cd "$(dirname "$0")/.."
: "${T:?the target GGUF}" "${P:?the prompts folder}" "${W:?a work dir}"
N=${N:-4096}
mkdir -p "$W"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() {
  local name=$1; shift
  echo "$(date +%T) $name start" >>"$W/progress"
  "$@" >"$W/$name.log" 2>&1
  local rc=$?  # before $(date), which resets $?
  echo "$(date +%T) $name rc=$rc" >>"$W/progress"
}
B=benchmarks/base_drafter.py
step off-gen python3 $B gen --replies dataset --target "$T" --pool "$P/train.jsonl.gz" --out "$W/off"
step off-train python3 $B train --target "$T" --out "$W/off" --export "$W/offpolicy" \
  --epochs 4 --lr 1e-3 --ttt 5 --tokens-per-batch 16384 --max-vocab 8192 --heldout 256 --curve ""
step regen python3 $B gen --target "$T" --pool "$P/train.jsonl.gz" --limit "$N" --out "$W/regen"
step held python3 $B gen --target "$T" --pool "$P/users.jsonl.gz" --out "$W/held"
S=benchmarks/finetune_sweep.py
INITS="--init base=drafters/smollm2-135m-base --init offpolicy=$W/offpolicy"
# the demo's round: ~512 samples, 2 CPU workers x 512-token batches, TTT 3
step sweep-cpu-shape python3 $S --target "$T" --train "$W/regen" --heldout "$W/held" $INITS \
  --export "$W/best-512" \
  --grid "n=512 lr=3e-4,1e-4,3e-5 anchor=0,1e-2,1 ttt=3 warmup=0.1 bs=1024 epochs=3" \
  --grid "n=512 lr=1e-4 anchor=0 ttt=3 warmup=0.015 bs=1024 epochs=3" \
  --grid "n=512 lr=1e-4 anchor=0 ttt=5 warmup=0.1 bs=1024 epochs=3"
# the GPU config's round: 4,096 samples, 16k-token batches, TTT 5
step sweep-gpu-shape python3 $S --target "$T" --train "$W/regen" --heldout "$W/held" $INITS \
  --export "$W/best-4096" \
  --grid "n=$N lr=3e-4,1e-4,3e-5 anchor=0,1e-2 ttt=5 warmup=0.1 bs=16384 epochs=3"
echo "$(date +%T) all done" >>"$W/progress"
