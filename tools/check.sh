#!/usr/bin/env bash
# The checks a change should pass before it is pushed, fastest first: lint, types, the deployment
# files (compose recipes resolved by docker-compose and cross-checked against the code, the
# Dockerfile through hadolint, the release script, server.json), the rest of the tests, and the
# image build when a Docker engine answers. A step whose tool is missing here says so and is
# skipped; .ci/run installs them all.
#
#   tools/check.sh            (PYTHON=path/to/python to use another environment than .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}

step() { printf '\n== %s\n' "$*"; }

step "lint and formatting (ruff)"
"$py" -m ruff check .
"$py" -m ruff format --check .

step "types (mypy, tools/typecheck.sh)"
if "$py" -m mypy --version >/dev/null 2>&1; then
  PYTHON="$py" tools/typecheck.sh
else
  echo "skipped: mypy is not installed ($py -m pip install mypy)"
fi

step "deployment files (tests/deploy)"
command -v docker-compose >/dev/null 2>&1 || echo "docker-compose is missing: the compose tests skip (apt-get install docker-compose)"
"$py" -m pytest -q tests/deploy

step "tests"
"$py" -m pytest -q --ignore=tests/deploy

step "image build"
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  docker build --tag luftpause/luftpause:check .
  docker run --rm luftpause/luftpause:check --version
else
  echo "skipped: no Docker engine answers here"
fi
