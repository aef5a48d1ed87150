"""The patching mechanism: ``Patch`` (one declared upstream replacement) and the registry that applies a set of
them atomically. What is replaced is declared in ``lmcache_platforms.upstream_fixes.catalog``, above."""
