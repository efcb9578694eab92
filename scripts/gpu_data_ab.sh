#!/usr/bin/env bash
# The climb's data shape from the shipped base on one GPU, without Ray (issue 55): the climb's
# round-0 pool slice as the loop draws it (ShareGPT turns with the earlier turns as context)
# against the same user turns alone (the context cut), each fine-tuned from the base with the
# sweep's recipe (benchmarks/finetune_sweep.py) and scored as the loop's benchmark scores
# (benchmarks/accept_eval.py: the demo's 48 held-out prompts, tree 5/4/12 and chain 3, greedy,
# 96 tokens as docs/training.md's sweep table).
# Inputs: T (the target's GGUF), P (multi.jsonl.gz, last.jsonl.gz, users.jsonl.gz and
# heldout-{chat,coding,math}.jsonl), W (work dir). GRID_MULTI / GRID_LAST: the rows.
#   T=/tmp/t.gguf P=/tmp/p W=/tmp/w setsid bash scripts/gpu_data_ab.sh &   # $W/progress
set -uo pipefail
cd "$(dirname "$0")/.."
: "${T:?the target GGUF}" "${P:?the prompts folder}" "${W:?a work dir}"
mkdir -p "$W/rows" "$W/scores"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
B=benchmarks/base_drafter.py
S=benchmarks/finetune_sweep.py
BASE=drafters/smollm2-135m-base
REC="anchor=0 ttt=5 warmup=0.1 bs=16384"
GRID_MULTI=${GRID_MULTI:-"n=4096 lr=3e-4 $REC epochs=4"}
GRID_LAST=${GRID_LAST:-"n=4096 lr=3e-4 $REC epochs=4"}
ARMS=${ARMS:-"last multi"}  # last: the user turn alone; multi: with its earlier turns
step() {
  local name=$1; shift
  echo "$(date +%T) $name start" >>"$W/progress"
  "$@" >"$W/$name.log" 2>&1
  local rc=$?
  echo "$(date +%T) $name rc=$rc" >>"$W/progress"
}
score() {  # score NAME DRAFTER
  python3 benchmarks/accept_eval.py --drafter "$2" --target "$T" --dtype bfloat16 --max-tokens "${MAX_TOKENS:-96}" \
    --prompts "$P/heldout-chat.jsonl" --prompts "$P/heldout-coding.jsonl" \
    --prompts "$P/heldout-math.jsonl" >"$W/scores/$1.json" 2>"$W/scores/$1.err"
}
gen() {  # gen NAME POOL LIMIT: the target's replies (kept when made: a rerun goes on from here)
  [ -f "$W/$1/samples.pt" ] || step "gen-$1" python3 $B gen --target "$T" --pool "$2" --out "$W/$1" \
    --limit "$3" $GEN_ARGS
}
GEN_ARGS=${GEN_ARGS:-}
# the first N of each file: enough for the rows' n (about 64% of the multi-turn prompts fit the
# 1,024-token prompt bound, all of the last turns do)
gen held "$P/users.jsonl.gz" 0
score base "$BASE" &  # beside the rest: the base's own score
for arm in $ARMS; do  # each arm's replies, then its rows (the arms' sweeps side by side)
  case $arm in last) lim=${LIMIT_LAST:-4200}; grid=$GRID_LAST ;; *) lim=${LIMIT_MULTI:-6600}; grid=$GRID_MULTI ;; esac
  gen "$arm" "$P/$arm.jsonl.gz" "$lim"
  step "sweep-$arm" python3 $S --target "$T" --train "$W/$arm" --heldout "$W/held" \
    --init "$arm=$BASE" --export-rows "$W/rows" --grid "$grid" &
done
wait
echo "$(date +%T) score start" >>"$W/progress"
for j in "$W"/rows/*.json; do
  r=$(basename "$j" .json)
  [ -d "$W/rows/$r" ] && score "$r" "$W/rows/$r" &  # a row that never beat the base exports none
done
wait
echo "$(date +%T) score done" >>"$W/progress"
python3 - "$W" >"$W/table.md" <<'PY'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
print("| row | n | sim3 start > kept (epoch) | tree chat | coding | math | tree mean | chain-3 mean |")
print("|---|---|---|---|---|---|---|---|")
sims = {}
for log in w.glob("sweep-*.log"):
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"row"' in line:
            r = json.loads(line)
            sims[r.get("result", r)["row"]] = r.get("result", r)
doms = ("heldout-chat", "heldout-coding", "heldout-math")
for p in sorted((w / "scores").glob("*.json")):
    if not p.stat().st_size:
        continue
    files = json.loads(p.read_text().splitlines()[-1])["files"]
    t = [files[d]["tree_5_4_12"]["accept_len"] for d in doms]
    c = [files[d]["chain_3"]["accept_len"] for d in doms]
    meta = json.loads((w / "rows" / f"{p.stem}.json").read_text()) if (w / "rows" / f"{p.stem}.json").exists() else {}
    s = sims.get(p.stem, {})
    gate = f"{s['start_sim3']:.3f} > {s['best_sim3']:.3f} ({s['best_epoch']})" if s else "-"
    print(f"| {p.stem} | {meta.get('n', '-')} | {gate} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | "
          f"{sum(t) / 3:.3f} | {sum(c) / 3:.3f} |")
for row, s in sorted(sims.items()):  # no state beat the base: the row serves the base
    if not (w / "scores" / f"{row}.json").exists():
        print(f"| {row} | {s['n']} | {s['start_sim3']:.3f} > {s['best_sim3']:.3f} ({s['best_epoch']}) | kept the base |||||")
PY
echo "$(date +%T) all done" >>"$W/progress"
