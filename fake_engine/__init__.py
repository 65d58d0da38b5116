"""A simulated OpenAI-compatible inference engine (SGLang- or vLLM-like) for tests and benchmarks without GPUs.

The engine model, one concept a module: `params` (every number, with its reasoning), `tokens`
(how text is counted), `prefix_cache` (message-sequence blocks, LRU eviction), `kv_pool`
(reservations of prompt + max_tokens), `waiting` (the engine's own queue), `engine` (the step
function over the engine's clock). `realtime` drives it on the wall clock; the simulator in
`bench/sim` drives it in virtual time. What it says: `replies` (deterministic tool calls),
`logprobs`, `classify`; the wire: `protocol`, `metrics`, `server` (`create_app`, `serve`).
Parameter overrides for a separate process: $LUFTPAUSE_FAKE_ENGINE_TIMING="field=value,...".
"""
