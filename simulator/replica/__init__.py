"""The emulated replica: the engine model served in real time with vLLM's HTTP, metrics and
KV-event surface."""
