#!/usr/bin/env bash
# Fill a folder with what bench/device_check.sh installs on a GPU machine that cannot download
# (`device_check.sh --wheels DIR`): the llama-cpp-python source, trimmed of its vocabulary
# samples and docs (the build needs neither), and wheels of meshagent's dependencies and test
# tools for that machine's Python, less the packages it already has.
#
# Usage: bench/device_wheels.sh [DIR] [--python 3.12] [--skip "numpy httpx ..."]
#   DIR       the folder to fill (default .whl)
#   --python  the GPU machine's Python version (default 3.12)
#   --skip    names of packages the GPU machine's Python already has (their wheels are left out)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=".whl" PYV="3.12" SKIP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PYV="$2"; shift 2 ;;
        --skip) SKIP="$2"; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) DIR="$1"; shift ;;
    esac
done
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The source, trimmed and packed again as an sdist pip builds.
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-0.3.36"
rm -rf "$src/.git" "$src/vendor/llama.cpp/models"/*.gguf "$src/vendor/llama.cpp/docs" \
    "$src/vendor/llama.cpp/tools/ui" "$src/docs"
tar -czf "$DIR/llama_cpp_python-0.3.36.tar.gz" -C "$tmp" llama_cpp_python-0.3.36

# Wheels: the package's dependencies (from pyproject.toml), what the check's tests use, and
# the build backends (setuptools for meshagent, scikit-build-core for llama-cpp-python).
mapfile -t reqs < <("$PY" - <<'EOF'
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if not d.startswith("llama-cpp-python"):
        print(d)
for d in ("pytest", "pytest-trio", "hypothesis", "setuptools", "wheel", "scikit-build-core",
          "cmake", "ninja", "diskcache", "typing-extensions"):
    print(d)
EOF
)
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$tmp/wheels" "${reqs[@]}"
for w in "$tmp"/wheels/*.whl; do
    name="$(basename "$w" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')"
    skip=0
    for s in $SKIP; do
        [ "$name" = "$(echo "$s" | tr '[:upper:]_.' '[:lower:]--')" ] && skip=1
    done
    [ $skip = 1 ] || cp "$w" "$DIR/"
done
echo "device_wheels: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1) in $DIR" >&2
