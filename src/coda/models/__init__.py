"""coda.models: Llama-style blocks and whole models built from coda.ops."""

from .llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM, from_hf
from .llama_block import BlockWeights, NativeBlockWeights, block_segment, qkv_to_standard, reference_block_segment
from .llama_ends import first_segment, last_segment

__all__ = [
    "BlockWeights", "NativeBlockWeights", "block_segment", "qkv_to_standard", "reference_block_segment",
    "first_segment", "last_segment", "LlamaForCausalLM", "LlamaConfig", "CausalLMOutput", "from_hf",
]
