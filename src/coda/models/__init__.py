"""coda.models: Llama-style blocks built from coda.ops."""

from .llama_block import BlockWeights, NativeBlockWeights, block_segment, qkv_to_standard, reference_block_segment

__all__ = ["BlockWeights", "NativeBlockWeights", "block_segment", "qkv_to_standard", "reference_block_segment"]
