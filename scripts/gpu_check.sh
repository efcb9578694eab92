#!/usr/bin/env bash
# The product on a one-GPU host, as users run it, in one go (docs/gpu-clusters.md). After
# scripts/gpu_host.sh has installed the wheels; each step logs to $DIR and a failed step does
# not stop the next:
#   1. `make demo`'s script with the GPU config: Ray head, MLflow server, `ray job submit`
#   2. benchmarks/pipeline_stages.py: each stage of rounds 0 and 1 again, standalone
#   3. the MLflow run list of the run
#   4. pytest -m gpu (Ray installed)
#   DIR=/tmp/gpu-check setsid bash scripts/gpu_check.sh &    # then watch $DIR/progress
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-/tmp/gpu-check}
CONFIG=${CONFIG:-configs/smollm2-1gpu.yaml}
mkdir -p "$DIR"
source <(bash scripts/gpu_host.sh env)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() { echo "$(date +%T) $1 start" >>"$DIR/progress"; shift; "$@"; echo "$(date +%T) rc=$?" >>"$DIR/progress"; }

step env bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c 'import torch, transformers, ray, mlflow; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"ray\", ray.__version__, \"mlflow\", mlflow.__version__)'" >"$DIR/env.txt" 2>&1
step demo env CONFIG="$CONFIG" RUN_DIR="$DIR/run" RAY_NUM_CPUS="$(nproc)" \
  bash scripts/demo.sh >"$DIR/demo.log" 2>&1
for r in 0 1; do
  step "stages-$r" python3 benchmarks/pipeline_stages.py --run-dir "$DIR/run" --round "$r" \
    --out "$DIR/stages-$r.jsonl" >"$DIR/stages-$r.log" 2>&1
done
step mlflow python3 - "$DIR/run/mlflow.db" >"$DIR/mlflow-runs.txt" 2>&1 <<'PY'
import sys, mlflow
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}")
runs = mlflow.search_runs(search_all_experiments=True)
cols = [c for c in ("run_id", "tags.mlflow.runName", "status", "metrics.bench/accept_len",
                    "metrics.bench/tok_per_s", "metrics.gate/promoted") if c in runs.columns]
print(runs[cols].to_string())
PY
step pytest-gpu timeout 1200 python3 -m pytest -q -m gpu -p no:cacheprovider tests >"$DIR/pytest-gpu.log" 2>&1
echo "$(date +%T) all done" >>"$DIR/progress"
