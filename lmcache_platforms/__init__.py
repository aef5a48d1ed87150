"""lmcache_platforms (activation comes with the foundation)."""
