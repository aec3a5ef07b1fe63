"""Layers shared by the model families of `shards.models`: pure torch, no processes."""
