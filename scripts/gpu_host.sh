#!/usr/bin/env bash
# Prepare a bare one-GPU host that has no network (torch and transformers preinstalled) for the
# project's GPU scripts: wheels carried in .whl/ go to /tmp/site, and the SmolLM2 GGUF, carried in
# parts over several calls (each call carries at most 64 MiB), is put back together under /tmp.
#   bash scripts/gpu_host.sh install      # pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash scripts/gpu_host.sh gguf         # cat /tmp/carry/gguf.part.* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
case "${1:-}" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl ;;
  gguf)
    mkdir -p /tmp/smollm2
    cat /tmp/carry/gguf.part.* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "a1231443440b107ff29f02bdb38c9d0a  /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | md5sum -c ;;
  *) echo "usage: $0 install|gguf" >&2; exit 2 ;;
esac
