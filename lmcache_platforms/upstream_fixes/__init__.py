"""What we put into upstream LMCache and vLLM: ``catalog`` (the one list of replaced upstream symbols) and the
fixes of upstream bugs it installs (remote close and lookups, disk and Redis reads, the offload server).

Above integration and connector: the catalog names their replacements (by ``module:attr`` strings, resolved
when the target module is imported, so importing the catalog imports neither LMCache nor vLLM); nothing below
imports this package.
"""
