"""shards package."""
