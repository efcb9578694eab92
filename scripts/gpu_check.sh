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
STEPS=${STEPS:-env demo stages mlflow pytest}  # a subset re-runs only those
# step NAME LOG CMD...: run CMD into $DIR/LOG, unless NAME is not in STEPS (its log then stays
# as an earlier run left it: the redirection lives in here, not on the caller's line)
step() {
  local name=$1 log=$DIR/$2; shift 2
  case " $STEPS " in *" ${name%%-*} "*) ;; *) return 0 ;; esac
  echo "$(date +%T) $name start" >>"$DIR/progress"
  "$@" >"$log" 2>&1
  local rc=$?  # before $(date), which resets $?
  echo "$(date +%T) $name rc=$rc" >>"$DIR/progress"
}

step env env.txt bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c 'import torch, transformers, ray, mlflow; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"ray\", ray.__version__, \"mlflow\", mlflow.__version__)'"
step demo demo.log env CONFIG="$CONFIG" RUN_DIR="$DIR/run" RAY_NUM_CPUS="$(nproc)" \
  bash scripts/demo.sh
for r in 0 1; do
  step "stages-$r" "stages-$r.log" python3 benchmarks/pipeline_stages.py --run-dir "$DIR/run" \
    --round "$r" --out "$DIR/stages-$r.jsonl"
done
step mlflow mlflow-runs.txt python3 - "$DIR/run/mlflow.db" <<'PY'
import sys, mlflow
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}")
runs = mlflow.search_runs(search_all_experiments=True)
cols = [c for c in ("run_id", "tags.mlflow.runName", "status", "metrics.bench/accept_len",
                    "metrics.bench/tok_per_s", "metrics.gate/promoted") if c in runs.columns]
print(runs[cols].to_string())
PY
# PYTEST_ARGS narrows it (e.g. "-m gpu -k capture_auto" for one new test)
step pytest pytest-gpu.log timeout 1200 python3 -m pytest -q ${PYTEST_ARGS:--m gpu} -p no:cacheprovider tests
echo "$(date +%T) all done" >>"$DIR/progress"
