"""LMCache GPU connectors over a KVLayout (paged and layerwise) and the one a vLLM engine of ours gets
(``factory``).

Submodules import LMCache; import them only where LMCache is wanted (this package module does not).
"""
