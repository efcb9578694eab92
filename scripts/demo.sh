#!/usr/bin/env bash
# `make demo`: a local Ray head and MLflow server on loopback, the loop submitted as a Ray job,
# progress streamed, then the per-round table. Re-running resumes the same run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
# The job's `python` is this venv's; a GPU host set up by scripts/gpu_host.sh has none (its
# python, Ray and MLflow are on PATH).
[ -f .venv/bin/activate ] && source .venv/bin/activate
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false
# Ray token auth: the head, `ray job submit` and the job's driver share ~/.ray/auth_token.
export RAY_AUTH_MODE=token
ray get-auth-token --generate >/dev/null
chmod 600 ~/.ray/auth_token  # Ray writes it 0644: readable by every local user
CONFIG=${CONFIG:-configs/smollm2-cpu.yaml}
RUN_DIR=$(realpath -m "${RUN_DIR:-demo-run}")
MLFLOW_PORT=${MLFLOW_PORT:-5000}
DASH_PORT=${DASH_PORT:-8265}
# The config's experiment and live server port (serve.port; SERVE_PORT overrides it), with this
# script's arguments (overrides, `a.b=v`) applied, as the job applies them
read -r EXPERIMENT CONFIG_SERVE_PORT INIT < <(python -c "import sys; from pipeline.config import load_config; c = load_config(sys.argv[1], sys.argv[2:]); print(c.tracking.experiment, c.serve.port, c.drafter.init)" "$CONFIG" "$@")
SERVE_PORT=${SERVE_PORT:-$CONFIG_SERVE_PORT}
mkdir -p "$RUN_DIR"
t0=$(date +%s)

# Refuse a taken port up front, naming the variable to change: a second MLflow server on the same
# port would leave the driver logging to someone else's store (or hanging on a dead one).
# SO_REUSEADDR as the servers bind: a listener still refuses it, the TIME_WAIT connections a
# demo that just ended leaves behind (for a minute) do not.
port_free() { python -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null; }
free_port() { python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
for var in MLFLOW_PORT DASH_PORT SERVE_PORT; do
  port_free "${!var}" || { echo "port ${!var} is taken (another MLflow, Ray or demo?); run with $var=<free port>"; exit 2; }
done

cleanup() {
  # This head only (its process group), never `ray stop --force`, which kills every Ray here.
  [ -n "${RAY_PID:-}" ] && { kill -TERM -- "-$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null; } || true
  # What `ray stop` does and a kill does not: forget this head as the machine's latest cluster.
  # A stale address there makes a later plain ray.init() connect to nothing, and every Ray
  # Train run's placement-group cleaner wait 12 s for a state API that never answers.
  [ -n "${GCS_PORT:-}" ] && [ "$(cat "$RAY_ADDRESS_FILE" 2>/dev/null)" = "127.0.0.1:$GCS_PORT" ] \
    && rm -f "$RAY_ADDRESS_FILE" || true
  [ -n "${MLFLOW_PID:-}" ] && kill "$MLFLOW_PID" 2>/dev/null || true
  [ -n "${RUNTIME_ENV:-}" ] && rm -f "$RUNTIME_ENV" || true
}
trap cleanup EXIT

# A light MLflow server (no job-execution workers) on sqlite inside the run directory.
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --workers 1 --host 127.0.0.1 --port "$MLFLOW_PORT" \
  --backend-store-uri "sqlite:///$RUN_DIR/mlflow.db" --artifacts-destination "$RUN_DIR/mlartifacts" \
  >"$RUN_DIR/mlflow.log" 2>&1 &
MLFLOW_PID=$!

# Secret env vars of the config's runtime_env (tokens, passwords) reach the job through this
# head's environment, which Ray's processes inherit, never through the job's runtime env: Ray
# shows that on its workers' command lines (pipeline/run.py split_secrets).
source <(python pipeline/run.py node-env "$CONFIG")
# Ray's own components log at warning: at info, its runtime-env agent writes every job's runtime
# env, env vars (tokens) included, into runtime_env_agent.log (seen with a planted HF_TOKEN).
# Every port of this head is a free one (Ray's fixed defaults clash with any other Ray here);
# --block in its own session, so the cleanup above stops exactly these processes.
GCS_PORT=$(free_port)
RAY_ADDRESS_FILE="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster"  # where ray start notes it
RAY_LOGGER_LEVEL=${RAY_LOGGER_LEVEL:-warning} \
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 setsid ray start --head --block --node-ip-address 127.0.0.1 \
  --port "$GCS_PORT" --ray-client-server-port "$(free_port)" \
  --dashboard-agent-listen-port "$(free_port)" --num-cpus "${RAY_NUM_CPUS:-4}" --dashboard-host 127.0.0.1 \
  --dashboard-port "$DASH_PORT" --disable-usage-stats >"$RUN_DIR/ray-start.log" 2>&1 &
RAY_PID=$!
: >>"$RUN_DIR/ray-start.log"
for _ in $(seq 120); do grep -q "Ray runtime started" "$RUN_DIR/ray-start.log" && break
  kill -0 "$RAY_PID" 2>/dev/null || { echo "Ray did not start: $RUN_DIR/ray-start.log"; exit 1; }; sleep 1; done

http_ok() { python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$1" 2>/dev/null; }
for _ in $(seq 90); do http_ok "http://127.0.0.1:$MLFLOW_PORT/health" && break; sleep 1; done
http_ok "http://127.0.0.1:$MLFLOW_PORT/health" || { echo "MLflow did not start: $RUN_DIR/mlflow.log"; exit 1; }
RAY_CMD=ray; [ -x .venv/bin/ray ] && RAY_CMD=.venv/bin/ray  # a new shell has no venv on its PATH
echo "Ray dashboard: http://127.0.0.1:$DASH_PORT   (it asks for a token: \`$RAY_CMD get-auth-token\` prints it)"
echo "MLflow UI:     http://127.0.0.1:$MLFLOW_PORT   (the job prints its runs page; in the UI: Model training, Experiments, $EXPERIMENT)"
echo "run dir:       $RUN_DIR"

# The runtime env (env vars included: tokens) goes in a file only this user reads, never on the
# `ray job submit` command line, where `ps` shows it to everyone; removed on exit.
RUNTIME_ENV=$(mktemp "${TMPDIR:-/tmp}/eagle-loop-runtime-env.XXXXXX.json")  # mode 600
# The job's overrides, given to the runtime env too: the resolved config decides what is uploaded
# (a `drafter.init=drafters/...` override must travel with the job).
OVERRIDES=("tracking.tracking_uri=http://127.0.0.1:$MLFLOW_PORT" "serve.port=$SERVE_PORT" "$@")
python pipeline/run.py runtime-env "$CONFIG" --set "${OVERRIDES[@]}" >"$RUNTIME_ENV"
# A fresh head refuses jobs ("No available agent") until its job agent is up.
for _ in $(seq 60); do ray job list --address "http://127.0.0.1:$DASH_PORT" >/dev/null 2>&1 && break; sleep 1; done
sleep 3
# The console shows the job's stage lines; everything else the job prints is in
# $RUN_DIR/logs/driver.log (pipeline/console.py). The submitting CLI logs at warning (at info it
# lists every file it leaves out of the upload). Ray's own default excludes are off: the job's
# runtime env excludes the same folders (pipeline/run.py UPLOAD_EXCLUDES), and with them on Ray
# warns about each one that exists.
# The shipped drafters the config does not start from stay out of the upload (pipeline/run.py
# unused_drafters); the one it starts from travels with the job, and Ray warns about its size.
[ -d "$INIT" ] && echo "uploading the working dir with the starting drafter $INIT (Ray warns below that its model.safetensors is over 10 MiB: the job needs it)"
RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES= ray --logging-level warning job submit \
  --address "http://127.0.0.1:$DASH_PORT" --runtime-env "$RUNTIME_ENV" -- \
  python pipeline/run.py --config "$CONFIG" --run-dir "$RUN_DIR" \
  --set "${OVERRIDES[@]}"

# This head's session folder, from its start-up log (session_latest may be another Ray's)
RAY_LOGS=$(sed 's/\x1b\[[0-9;]*m//g' "$RUN_DIR/ray-start.log" | grep -o '/[^ ]*/logs/ray_process_exit.log' | head -1)
echo "demo wall time: $(( $(date +%s) - t0 )) s"
echo "The Ray head and this MLflow server stop now. To look again:"
echo "  make ui                      # MLflow UI of $RUN_DIR on http://127.0.0.1:$MLFLOW_PORT"
echo "  less $RUN_DIR/logs/driver.log   # all else the job printed: HTTP requests, Serve, MLflow, Ray workers"
echo "  ls ${RAY_LOGS%/ray_process_exit.log}   # Ray's own logs of this head (job-driver-*.log, worker-*, serve/)"
