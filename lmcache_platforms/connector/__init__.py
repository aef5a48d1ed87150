"""LMCache GPU connectors over a KVLayout (paged and layerwise), the factory that replaces upstream's
``CreateGPUConnector``, and the engine round trip behind ``lmcache-platforms selftest``.

Submodules import LMCache; import them only where LMCache is wanted (this package module does not).
"""
