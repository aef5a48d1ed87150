"""LMCache GPU connectors over a KVLayout (paged and layerwise) and the factory that replaces upstream's
``CreateGPUConnector``.

Submodules import LMCache; import them only where LMCache is wanted (this package module does not).
"""
