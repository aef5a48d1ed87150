"""Fault injection with real components: a real vLLM engine or server, real LMCache backends, real Redis."""
