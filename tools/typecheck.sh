#!/usr/bin/env bash
# Type-checks the installed `luftpause` namespace with mypy: `luftpause.scheduler` and
# `luftpause.dataplane` strict, the rest at mypy's defaults (the settings live in pyproject.toml,
# [tool.mypy]). The repository maps its top-level folders onto the namespace with setuptools'
# package-dir, which mypy cannot follow through the editable install, so the namespace is rebuilt
# as a tree of symlinks in a temporary folder and checked there; errors name the repository's
# files. Exits non-zero on any error.
#
#   tools/typecheck.sh                  (PYTHON=path/to/python to use another environment than .venv)
#   tools/typecheck.sh -- EXTRA_ARGS    (passed on to mypy, e.g. -- --no-incremental)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
if [[ $py == */* && $py != /* ]]; then py="$PWD/$py"; fi # mypy runs in another folder
[ "${1:-}" = "--" ] && shift

folders=(proto scheduler dataplane runtime fake_engine fake_mcp loadgen bench)

tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/luftpause"
ln -s "$root"/luftpause/*.py "$tree/luftpause/"
for folder in "${folders[@]}"; do
  ln -s "$root/$folder" "$tree/luftpause/$folder"
done

# mypy reports the tree's paths (luftpause/scheduler/core.py); sed turns them back into the
# repository's (scheduler/core.py). pipefail keeps mypy's exit status.
unmap=()
for folder in "${folders[@]}"; do
  unmap+=(-e "s#^luftpause/$folder/#$folder/#")
done
cd "$tree"
"$py" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p luftpause "$@" | sed "${unmap[@]}"
