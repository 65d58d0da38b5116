"""A fake MCP tool server (`lookup`, `deep_search`) that stands in for real tool servers in tests and demos."""
