#!/usr/bin/env bash
# The fine-tuning recipe's sweep on one GPU, without Ray, scored by the loop's own benchmark
# (docs/training.md, "Fine-tuning a trained drafter"):
#   1. on-policy data: the target regenerates the fresh pool prompts (none of them the base
#      drafter's training prompts), the gate's prompts (the simulated users', never trained on
#      nor benchmarked) and the demo's round-1-sized prompt set
#   2. the sweep (benchmarks/finetune_sweep.py): the GPU regime (the shipped base, N fresh pool
#      prompts: lr x anchor at 2 epochs, then epochs and a frozen lm_head) and the demo regime
#      (the off-policy drafter, ~100k tokens); each row exports the state its best-by-gate choice
#      keeps
#   3. every row, and both starting drafters, scored as the loop's benchmark scores: held-out
#      accept_len per domain (the demo's 48 held-out prompts), tree 5/4/12 and chain 3, greedy,
#      bf16 (benchmarks/accept_eval.py, several at once on the one GPU)
#   4. the GPU regime's best row by that benchmark, again on all the fresh prompts, and a scratch
#      drafter trained on the same data (capacity against recipe), both scored alike
# Inputs: T (the target's GGUF), P (a folder: pool.jsonl.gz, users.jsonl.gz, demo.jsonl.gz,
# heldout-{chat,coding,math}.jsonl), W (work dir).
#   T=/tmp/t.gguf P=.carry/prompts W=/tmp/w setsid bash scripts/gpu_sweep.sh &   # $W/progress
set -uo pipefail
cd "$(dirname "$0")/.."
: "${T:?the target GGUF}" "${P:?the prompts folder}" "${W:?a work dir}"
N=${N:-4096}
JOBS=${JOBS:-8}
mkdir -p "$W/rows" "$W/scores"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-regen held demo-regen sweep-gpu sweep-demo score round-all scratch score-last}
step() {
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "$(date +%T) $name start" >>"$W/progress"
  "$@" >"$W/$name.log" 2>&1
  local rc=$?  # before $(date), which resets $?
  echo "$(date +%T) $name rc=$rc" >>"$W/progress"
}
# score NAME...: accept_eval on each drafter folder $W/rows/NAME (JOBS at a time)
score() {
  printf '%s\n' "$@" | xargs -P "$JOBS" -I{} sh -c "python3 benchmarks/accept_eval.py \
    --drafter \$(cat $W/rows/{}.path 2>/dev/null || echo $W/rows/{}) --target $T --dtype bfloat16 \
    --max-tokens ${MAX_TOKENS:-128} --prompts $P/heldout-chat.jsonl --prompts $P/heldout-coding.jsonl \
    --prompts $P/heldout-math.jsonl >$W/scores/{}.json 2>$W/scores/{}.err"
}
B=benchmarks/base_drafter.py
S=benchmarks/finetune_sweep.py
step regen python3 $B gen --target "$T" --pool "$P/pool.jsonl.gz" --out "$W/regen"
step held python3 $B gen --target "$T" --pool "$P/users.jsonl.gz" --out "$W/held"
step demo-regen python3 $B gen --target "$T" --pool "$P/demo.jsonl.gz" --max-new-tokens 128 \
  --out "$W/demo"
GRIDS=${GRIDS:-"n=$N lr=2e-5,1e-4,3e-4,1e-3 anchor=0,1e-4,1e-3,1e-2 ttt=5 warmup=0.1 bs=16384 epochs=2;n=$N lr=1e-4,3e-4 anchor=0 ttt=5 warmup=0.1 bs=16384 epochs=1,4;n=$N lr=1e-4,3e-4 anchor=0 ttt=5 warmup=0.1 bs=16384 epochs=2 head=1"}
IFS=';' read -ra GRID_ARGS <<<"$GRIDS"
ARGS=(); for g in "${GRID_ARGS[@]}"; do ARGS+=(--grid "$g"); done
step sweep-gpu python3 $S --target "$T" --train "$W/regen" --heldout "$W/held" \
  --init "${INIT_NAME:-base}=drafters/smollm2-135m-base" --export-rows "$W/rows" "${ARGS[@]}"
step sweep-demo python3 $S --target "$T" --train "$W/demo" --heldout "$W/held" \
  --init offpolicy=drafters/smollm2-135m-offpolicy --export-rows "$W/rows" \
  --grid "n=1024 lr=1e-4,3e-4,1e-3 anchor=0,1e-3 ttt=3 warmup=0.1 bs=1024 epochs=2"
# a row whose trained states never beat its start exports nothing: it serves its start
for j in "$W"/rows/*.json; do
  r=$(basename "$j" .json); [ -d "$W/rows/$r" ] && continue
  case $r in base*|all-*) echo drafters/smollm2-135m-base ;; *) echo drafters/smollm2-135m-offpolicy ;; esac >"$W/rows/$r.path"
done
echo drafters/smollm2-135m-base >"$W/rows/start-base.path"
echo drafters/smollm2-135m-offpolicy >"$W/rows/start-offpolicy.path"
step score score start-base start-offpolicy $(cd "$W/rows" && ls *.json | sed 's/\.json$//')
# the GPU regime's best row by the benchmark (mean of the tree's three domains), on all the data
BEST=$(python3 - "$W" <<'PY'
import json, pathlib, statistics, sys
w = pathlib.Path(sys.argv[1])
def tree(p):
    files = json.loads(p.read_text().splitlines()[-1])["files"]
    return statistics.fmean(f["tree_5_4_12"]["accept_len"] for f in files.values())
rows = {p.stem: tree(p) for p in (w / "scores").glob("base*-*.json") if p.stat().st_size}
best = max(rows, key=rows.get)
print(" ".join(f"{k}={v}" for k, v in json.loads((w / "rows" / f"{best}.json").read_text()).items()
               if k in ("lr", "anchor", "epochs", "head")))
PY
)
echo "$(date +%T) best row: $BEST" >>"$W/progress"
eval "$BEST"
step round-all python3 $S --target "$T" --train "$W/regen" --heldout "$W/held" \
  --init all=drafters/smollm2-135m-base --export-rows "$W/rows" \
  --grid "n=100000 lr=$lr anchor=$anchor ttt=5 warmup=0.1 bs=16384 epochs=$epochs head=$head"
step scratch python3 $B train --target "$T" --out "$W/regen" --export "$W/rows/scratch-00" \
  --epochs "${SCRATCH_EPOCHS:-4}" --lr 1e-3 --ttt 5 --tokens-per-batch 16384 --max-vocab 8192 --heldout 256 --curve ""
[ -d "$W/rows/all-00" ] || echo drafters/smollm2-135m-base >"$W/rows/all-00.path"
step score-last score all-00 scratch-00
python3 - "$W" >"$W/table.md" <<'PY'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
print("| row | init | n | lr | anchor | epochs | head | gate sim3 start>best (epoch) | tree chat | coding | math | mean | chain-3 mean |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
sims = {}
for log in sorted(w.glob("*.log")):
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"row"' in line:
            r = json.loads(line)
            r = r.get("result", r)
            sims[r["row"]] = r
for p in sorted((w / "scores").glob("*.json")):
    if not p.stat().st_size:
        continue
    files = json.loads(p.read_text().splitlines()[-1])["files"]
    t = [files[d]["tree_5_4_12"]["accept_len"] for d in ("heldout-chat", "heldout-coding", "heldout-math")]
    c = [files[d]["chain_3"]["accept_len"] for d in ("heldout-chat", "heldout-coding", "heldout-math")]
    meta = json.loads((w / "rows" / f"{p.stem}.json").read_text()) if (w / "rows" / f"{p.stem}.json").exists() else {}
    s = sims.get(p.stem, {})
    gate = f"{s['start_sim3']:.3f}>{s['best_sim3']:.3f} ({s['best_epoch']})" if s else "-"
    print(f"| {p.stem} | {meta.get('init', '-')} | {meta.get('n', '-')} | {meta.get('lr', '-')} | {meta.get('anchor', '-')} | "
          f"{meta.get('epochs', '-')} | {meta.get('head', '-')} | {gate} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | "
          f"{sum(t) / 3:.3f} | {sum(c) / 3:.3f} |")
PY
echo "$(date +%T) all done" >>"$W/progress"
