"""The MCP runtime: spawn / await sub-agents whose loops run their turns through the dataplane."""
