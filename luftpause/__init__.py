"""luftpause: the runtime layer between agent harnesses and LLM inference engines.

The services live in the repository's top-level folders and are installed under this namespace:
`luftpause.scheduler`, `luftpause.dataplane`, `luftpause.runtime`, `luftpause.fake_engine`,
`luftpause.fake_mcp`, `luftpause.loadgen`, `luftpause.bench`, and the gRPC contract in
`luftpause.proto`. This package itself holds what they share: the config file and the CLI.
"""

__version__ = "0.1.0"
