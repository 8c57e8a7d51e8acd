#!/usr/bin/env bash
# How far the CUDA install line of docs/gpu.md runs on a machine without a GPU: llama-cpp-python
# configured with CUDA by pip, as that line does, and one ggml-cuda object compiled for the
# architecture given (a whole CUDA build takes over an hour on two cores; the GPU machine does
# it in bench/device_check.sh). Prints each step and exits 0 when both succeed.
#
# The CUDA compiler is nvcc on PATH or in $CUDA_HOME/bin if there is one, else CUDA 13's own
# wheels from PyPI (nvidia-cuda-nvcc and friends, about 600 MB) in a throwaway environment.
# Usage: bench/cuda_build_check.sh [--arch 90] [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=90 KEEP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCH="$2"; shift 2 ;;
        --keep) KEEP="$2"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "cuda_build_check: unknown argument $1" >&2; exit 2 ;;
    esac
done
say() { echo "cuda_build_check: $*" >&2; }
work="${KEEP:-$(mktemp -d)}"
mkdir -p "$work"
[ -n "$KEEP" ] || trap 'rm -rf "$work"' EXIT
PY="${PYTHON:-python3}"
"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/pip" install -q --disable-pip-version-check)

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
extra=""
if [ -n "$NVCC" ]; then
    root="$(dirname "$(dirname "$(realpath "$(sh -c "command -v $NVCC")")")")"
    # ggml-cuda links cuBLAS: a compiler without it cannot build the backend.
    if ! ls "$root"/lib*/libcublas.so* "$root"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
        say "the nvcc at $root has no cuBLAS beside it: using PyPI's toolkit instead"
        NVCC=""
    elif ! ls "$root"/lib*/stubs/libcuda.so "$root"/targets/*/lib/stubs/libcuda.so >/dev/null 2>&1; then
        extra="-DGGML_CUDA_NO_VMM=ON"  # no driver stub to link ggml's VMM pool against
    fi
fi
if [ -z "$NVCC" ]; then
    say "installing CUDA 13's compiler, runtime and cuBLAS from PyPI"
    "${pip[@]}" nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cublas nvidia-cuda-cccl
    cu="$(echo "$work"/venv/lib/python3*/site-packages/nvidia/cu13)"
    # CMake's FindCUDAToolkit looks for unversioned library names; the wheels ship .so.13.
    for l in "$cu"/lib/lib*.so.13; do ln -sf "$(basename "$l")" "${l%.13}"; done
    NVCC="$cu/bin/nvcc"
    # The wheels have no driver stub (libcuda.so): build without ggml's VMM pool, which links it.
    extra="-DGGML_CUDA_NO_VMM=ON"
fi
export PATH="$(dirname "$NVCC"):$PATH"
say "nvcc: $("$NVCC" --version | tail -2 | head -1)"

# docs/gpu.md's line, with the architecture named (no GPU to detect it from), stopped after
# configuring and building one CUDA object (scikit-build-core's build.targets).
"${pip[@]}" scikit-build-core cmake ninja
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$work/src"
object="vendor/llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/arange.cu.o"
set +e
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_LLAMAFILE=OFF -DCMAKE_CUDA_ARCHITECTURES=$ARCH $extra" \
    CMAKE_BUILD_PARALLEL_LEVEL=1 "$work/venv/bin/pip" install -v --no-deps --no-build-isolation \
    "$work"/src/llama_cpp_python-0.3.36.tar.gz -C build-dir="$work/build" \
    -C build.targets="$object" >"$work/pip.log" 2>&1
set -e
grep -E "CUDA compiler identification|Found CUDAToolkit|Using CMAKE_CUDA_ARCHITECTURES|Including CUDA backend" \
    "$work/pip.log" | sed 's/^ */  /' >&2 || true
if ! grep -q "Including CUDA backend" "$work/pip.log"; then
    say "FAILED: CMake did not configure the CUDA backend; the log is $work/pip.log"
    [ -n "$KEEP" ] || tail -30 "$work/pip.log" >&2
    exit 1
fi
say "configured with CUDA"
if [ ! -s "$work/build/$object" ]; then
    say "FAILED: $(basename "$object") was not built; the log is $work/pip.log"
    [ -n "$KEEP" ] || tail -30 "$work/pip.log" >&2
    exit 1
fi
if command -v readelf >/dev/null && ! readelf -S "$work/build/$object" | grep -q nv_fatbin; then
    say "FAILED: $(basename "$object") holds no GPU code (.nv_fatbin)"
    exit 1
fi
say "compiled $(basename "$object") for sm_$ARCH ($(stat -c %s "$work/build/$object") bytes, GPU code in .nv_fatbin)"
say "ok: the CUDA line configures and compiles; the rest of the build runs on the GPU machine"
