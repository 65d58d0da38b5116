"""tools/release.sh: what a dry run prints and leaves alone, and what a real run does.

`docker` is a stand-in on PATH that records its arguments, so a real run can be watched without
a Docker engine; the real run happens in a clone, so its git tag lands there.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VERSION = "v" + tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose `docker` only appends its arguments to a log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "LUFTPAUSE_REGISTRY")}
    env |= {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env, log


def release(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "tools/release.sh", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def checkout(directory: Path, env: dict[str, str]) -> Path:
    """A committed git repository with this checkout's release script, pyproject.toml and server.json."""
    (directory / "tools").mkdir(parents=True)
    for name in ("tools/release.sh", "pyproject.toml", "server.json"):
        (directory / name).write_bytes((ROOT / name).read_bytes())
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "a release"]):
        subprocess.run(["git", *command], cwd=directory, env=env, check=True, timeout=30)
    return directory


def compose_image(version: str) -> str:
    """The image compose.yaml runs for LUFTPAUSE_VERSION=`version`, its defaults filled in."""
    template = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["scheduler"]["image"]
    return re.sub(
        r"\$\{(\w+):-([^}]*)\}", lambda m: version if m[1] == "LUFTPAUSE_VERSION" else m[2], template
    )


def test_a_dry_run_prints_build_tag_and_push_and_creates_nothing(fake_docker) -> None:
    env, docker_log = fake_docker
    tags_before = subprocess.run(["git", "tag", "-l"], cwd=ROOT, capture_output=True, text=True).stdout
    done = release(ROOT, {**env, "DRY_RUN": "1"}, VERSION)
    assert done.returncode == 0, done.stderr
    image = compose_image(VERSION)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("docker build ") and f"--tag {image}" in lines[0]
    assert (
        f"--tag {image.rsplit(':', 1)[0]}:latest" in lines[0] and f"LUFTPAUSE_VERSION={VERSION}" in lines[0]
    )
    assert lines[1:3] == [f"docker push {image}", f"docker push {image.rsplit(':', 1)[0]}:latest"]
    assert lines[3].startswith(f"git tag --annotate {VERSION} ")
    assert not docker_log.exists(), "a dry run ran docker"
    assert (
        subprocess.run(["git", "tag", "-l"], cwd=ROOT, capture_output=True, text=True).stdout == tags_before
    )


def test_the_registry_comes_from_luftpause_registry(fake_docker) -> None:
    env, _ = fake_docker
    done = release(ROOT, {**env, "DRY_RUN": "1", "LUFTPAUSE_REGISTRY": "registry.example:5000/team"}, VERSION)
    assert f"docker push registry.example:5000/team/luftpause:{VERSION}" in done.stdout


@pytest.mark.parametrize(
    ("version", "message"), [("0.1.0", "usage"), ("v1.2", "usage"), ("v9.9.9", "pyproject.toml says version")]
)
def test_a_wrong_version_is_refused(fake_docker, version: str, message: str) -> None:
    env, docker_log = fake_docker
    done = release(ROOT, {**env, "DRY_RUN": "1"}, version)
    assert done.returncode != 0 and message in done.stderr and not docker_log.exists()


def test_a_real_run_builds_pushes_and_tags(fake_docker, tmp_path: Path) -> None:
    env, docker_log = fake_docker
    clone = checkout(tmp_path / "clone", env)
    done = release(clone, env, VERSION)
    assert done.returncode == 0, done.stderr
    image = compose_image(VERSION)
    calls = docker_log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["build", "push", "push"] and calls[1] == f"push {image}"
    tags = subprocess.run(["git", "tag", "-l"], cwd=clone, capture_output=True, text=True).stdout.split()
    assert tags == [VERSION]
    again = release(clone, env, VERSION)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_a_real_run_refuses_uncommitted_changes(fake_docker, tmp_path: Path) -> None:
    env, docker_log = fake_docker
    clone = checkout(tmp_path / "clone", env)
    (clone / "pyproject.toml").write_text((clone / "pyproject.toml").read_text() + "\n# changed\n")
    done = release(clone, env, VERSION)
    assert done.returncode == 1 and "commit or stash" in done.stderr and not docker_log.exists()


def test_a_server_json_left_behind_is_refused(fake_docker, tmp_path: Path) -> None:
    env, docker_log = fake_docker
    clone = checkout(tmp_path / "clone", env)
    entry = (clone / "server.json").read_text().replace(f'"version": "{VERSION[1:]}"', '"version": "0.0.9"')
    (clone / "server.json").write_text(entry)
    done = release(clone, {**env, "DRY_RUN": "1"}, VERSION)
    assert done.returncode == 1 and "server.json" in done.stderr and not docker_log.exists()
