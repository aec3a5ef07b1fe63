"""One module per model family, built from `shards.layers`; `LayerRange` holds a shard's part."""

from layersplit.shards.models.range import LayerRange

__all__ = ["LayerRange"]
