#!/usr/bin/env bash
# Idempotent set-up: a .venv at the repository root with TensorFlow, Keras, a Horovod
# built against that TensorFlow (Gloo, no XLA ops), and tfdp itself.
#
# The Horovod wheel is cached outside the repository (TFDP_CACHE, default ~/.cache/tfdp),
# so a second set-up takes seconds. Usage: bash tools/setup_env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TFDP_VENV:-$ROOT/.venv}"
CACHE="${TFDP_CACHE:-$HOME/.cache/tfdp}"
HOROVOD_VERSION=0.28.1
PY="${PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip wheel setuptools
log "installing pinned dependencies"
"$VPY" -m pip install --quiet -r "$ROOT/requirements.txt"

# GPUs: Horovod's NCCL operations need a CUDA toolkit (nvcc) and NCCL's headers.
nccl_home() {
  local d
  for d in "${NCCL_HOME:-}" /usr /usr/local/cuda /usr/local/nccl; do
    if [ -n "$d" ] && [ -f "$d/include/nccl.h" ]; then echo "$d"; return 0; fi
  done
  return 1
}
BUILD=cpu
if command -v nvcc >/dev/null && NCCL_DIR="$(nccl_home)"; then
  BUILD=nccl
  log "CUDA toolkit and NCCL ($NCCL_DIR) found: Horovod with NCCL, and TensorFlow with CUDA"
  "$VPY" -m pip install --quiet "tensorflow[and-cuda]==$("$VPY" -c 'import tensorflow as tf; print(tf.__version__)')"
else
  log "no CUDA toolkit with NCCL here: Horovod for CPUs (Gloo)"
fi

horovod_ok() {
  "$VPY" - <<'PY' 2>/dev/null
import horovod.tensorflow as hvd
hvd.init()
assert hvd.size() >= 1
PY
}

build_horovod_wheel() {
  local work
  work="$(mktemp -d)"
  log "building horovod $HOROVOD_VERSION from source against the installed TensorFlow (3-7 min)"
  "$VPY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  local src="$work/horovod-$HOROVOD_VERSION"
  # xla_mpi_ops.cc needs XLA headers that the TF wheel does not ship; without it Horovod
  # ops simply cannot run inside jit_compile=True graphs, which tfdp refuses anyway.
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  # "cmake" from PyPI if the system has none.
  command -v cmake >/dev/null || "$VPY" -m pip install --quiet cmake
  local with_mpi=0
  command -v mpicxx >/dev/null && with_mpi=1
  (
    cd "$src"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
           HOROVOD_WITH_GLOO=1 MAKEFLAGS="-j$(nproc)"
    if [ "$BUILD" = nccl ]; then export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$NCCL_DIR"; fi
    if [ "$with_mpi" = 1 ]; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
    PATH="$VENV/bin:$PATH" "$VPY" -m pip wheel --no-build-isolation --no-deps -w "$CACHE/wheels" . >"$work/build.log" 2>&1 \
      || { tail -40 "$work/build.log" >&2; log "horovod build failed; full log in $work/build.log"; exit 1; }
  )
  rm -rf "$work"
}

if horovod_ok; then
  log "horovod already works with TensorFlow"
else
  mkdir -p "$CACHE/wheels"
  TF_VERSION="$("$VPY" -c 'import tensorflow as tf; print(tf.__version__)')"
  # The wheel is only valid for the TensorFlow it was compiled against.
  STAMP="$CACHE/wheels/horovod-$HOROVOD_VERSION.tf-$TF_VERSION"
  if [ "$BUILD" = nccl ]; then STAMP="$STAMP-nccl"; fi
  if [ ! -f "$STAMP" ] || ! ls "$CACHE"/wheels/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1; then
    rm -f "$CACHE"/wheels/horovod-"$HOROVOD_VERSION"-*.whl
    build_horovod_wheel
    touch "$STAMP"
  else
    log "using cached horovod wheel for TF $TF_VERSION"
  fi
  "$VPY" -m pip install --quiet --force-reinstall --no-deps "$CACHE"/wheels/horovod-"$HOROVOD_VERSION"-*.whl
  # horovod's own runtime deps (cloudpickle, psutil, pyyaml, packaging) come from requirements.txt.
  horovod_ok || { log "horovod installed but does not import with TensorFlow"; exit 1; }
fi

log "installing tfdp"
"$VPY" -m pip install --quiet --no-deps -e "$ROOT"
log "done: $VENV"
