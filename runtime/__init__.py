"""The MCP runtime: sub-agents spawned over MCP whose loops run their turns through the dataplane.

Modules: server (the MCP server, its tools and GET /status), runs (runs and the run tree),
agent (the sub-agent loop), journal (runs.jsonl), tasks (MCP Tasks and tasks.jsonl), budgets,
approvals, tool_servers (upstream MCP servers over HTTP or stdio), tool_calls (tool-call
hygiene), llm (the dataplane client), auth (the bearer token and CORS).
"""
