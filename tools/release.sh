#!/usr/bin/env bash
# Cuts a release: tools/release.sh vX.Y.Z
#
# Builds the one luftpause image from this checkout, tags it vX.Y.Z and latest, pushes both to
# $LUFTPAUSE_REGISTRY (default "luftpause", the namespace compose.yaml pulls from), and creates
# the annotated git tag vX.Y.Z on HEAD. `LUFTPAUSE_VERSION=vX.Y.Z docker compose up -d` then runs
# exactly that image. With DRY_RUN=1 it checks the same things and prints each command instead of
# running it, so nothing is built, pushed or tagged.
#
# It refuses a version that is not vX.Y.Z or differs from pyproject.toml's or server.json's, a tag
# that already exists, and (unless DRY_RUN=1, where it only warns) uncommitted changes.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-}
if [[ ! $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: tools/release.sh vX.Y.Z   (DRY_RUN=1 prints the commands only)" >&2
  exit 2
fi
dry_run=${DRY_RUN:-0}
registry=${LUFTPAUSE_REGISTRY:-luftpause}
image="${registry%/}/luftpause"

declared=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
if [ "v$declared" != "$version" ]; then
  echo "release: pyproject.toml says version $declared; bump it to ${version#v} and commit first" >&2
  exit 1
fi
listed=$(python3 -c 'import json; print(json.load(open("server.json"))["version"])')
if [ "v$listed" != "$version" ]; then
  echo "release: server.json (the MCP Registry entry) says version $listed; update it to ${version#v}" >&2
  exit 1
fi
if git rev-parse -q --verify "refs/tags/$version" >/dev/null; then
  echo "release: tag $version already exists" >&2
  exit 1
fi
if [ -n "$(git status --porcelain)" ]; then
  if [ "$dry_run" = 1 ]; then
    echo "# warning: uncommitted changes; a real release refuses to run" >&2
  else
    echo "release: commit or stash your changes first (git status)" >&2
    exit 1
  fi
fi

run() {
  if [ "$dry_run" = 1 ]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

run docker build --build-arg "LUFTPAUSE_VERSION=$version" --tag "$image:$version" --tag "$image:latest" .
run docker push "$image:$version"
run docker push "$image:latest"
run git tag --annotate "$version" --message "luftpause $version"
if [ "$dry_run" != 1 ]; then
  echo "released $image:$version; publish the tag with: git push origin $version"
fi
