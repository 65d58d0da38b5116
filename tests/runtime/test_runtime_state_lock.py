"""One runtime per state directory: a second one on the same directory exits at once with a
message naming the first, and leaves the journal as it was (real processes)."""

from pathlib import Path

import httpx
from support import Service, free_port, wait_until


def runtime_service(directory: Path, state: Path, name: str) -> tuple[Service, int]:
    port = free_port()
    config = directory / f"{name}.toml"
    # No dataplane behind it and no tool servers: the lock is taken before either matters.
    config.write_text(
        f"""
[runtime]
port = {port}
dataplane = "http://127.0.0.1:{free_port()}"
state_dir = "{state}"
mcp_servers = []
"""
    )
    return Service(name, ["runtime", "--config", str(config)], directory / f"{name}.log"), port


def test_a_second_runtime_on_the_same_state_directory_exits_and_leaves_the_journal_alone(tmp_path):
    state = tmp_path / "state"
    first, first_port = runtime_service(tmp_path, state, "first")
    second, _ = runtime_service(tmp_path, state, "second")
    try:
        first.start().wait_http(f"http://127.0.0.1:{first_port}/status")
        # A torn last line: a runtime that got as far as opening the journal would end it with a
        # newline, and one that replayed it would warn about it.
        journal = state / "runs.jsonl"
        with journal.open("ab") as f:
            f.write(b'{"v":1,"type":"spawned","run":"run-torn"')
        before = {p.name: p.read_bytes() for p in state.iterdir()}

        second.start()
        wait_until(lambda: not second.alive(), 15, what="the second runtime to exit")
        assert second.proc is not None and second.proc.returncode == 1
        message = second.output()
        assert f"state directory {state} is in use by another runtime (pid {first.proc.pid})" in message
        assert "another --state-dir" in message
        assert "resuming" not in message and "torn" not in message

        assert {p.name: p.read_bytes() for p in state.iterdir()} == before
        assert first.alive()
        assert httpx.get(f"http://127.0.0.1:{first_port}/status", timeout=5).status_code == 200
    finally:
        second.stop()
        first.stop()


def test_the_lock_goes_with_the_runtime_so_the_next_one_starts(tmp_path):
    state = tmp_path / "state"
    first, first_port = runtime_service(tmp_path, state, "first")
    first.start().wait_http(f"http://127.0.0.1:{first_port}/status")
    first.kill()  # SIGKILL: no clean-up of its own
    second, second_port = runtime_service(tmp_path, state, "second")
    try:
        second.start().wait_http(f"http://127.0.0.1:{second_port}/status")
    finally:
        second.stop()
