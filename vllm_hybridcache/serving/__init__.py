"""The serving surface: `--plugin hybridcache` flags, the /v1/cache routes, metrics export."""
