"""coda.models: Llama-style blocks built from coda.ops."""

from .llama_block import BlockWeights, block_segment, qkv_to_standard, reference_block_segment

__all__ = ["BlockWeights", "block_segment", "qkv_to_standard", "reference_block_segment"]
