"""The MCP runtime: sub-agents spawned over MCP whose loops run their turns through the dataplane.

Modules: server (the MCP server and GET /status), mcp_tools (its tools), parts (the runtime's
parts wired together), elicitation (asking the harness user about approvals), spec (spawn's
arguments and the journaled spec), run (one run and the run tree), runs (the registry of runs),
views (a run as the tools and /status show it), waiting (await), restore (runs across restarts
and the archive), budgets, approvals, agent (the sub-agent loop), store (the run store's
interface), journal (runs.jsonl, the embedded store), postgres_store (the store runtimes share),
leases (one runtime drives each run of a shared store), tasks
(MCP Tasks and tasks.jsonl), tool_servers (upstream MCP servers over HTTP or stdio), tool_calls
(tool-call hygiene), llm (the dataplane client), callers (who asks), auth (the bearer token and
CORS).
"""
