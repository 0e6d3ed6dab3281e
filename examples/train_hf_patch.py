"""Patch a transformers Llama model with coda.patch and train it for a few steps.

coda.patch runs the model's RMSNorms, its SwiGLU MLPs and the LM head's cross-entropy through
coda's fused GEMM-epilogue ops, in place; the q/k/v projections, RoPE and attention stay HF's.
Parameter names, the state_dict and generate() stay those of transformers. The first loss is computed before and after patching on the same weights,
so the two can be compared.

    python examples/train_hf_patch.py                     # a tiny model: seconds on the CPU
    python examples/train_hf_patch.py --hidden 2048 --ffn 8192 --layers 16 --heads 32 --kv-heads 8 \
        --vocab 128256 --batch 2 --seq 4096 --dtype bfloat16   # Llama-3.2-1B's shape, on a GPU
"""

from __future__ import annotations

import argparse

import torch
import transformers

import coda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      vocab_size=args.vocab, tie_word_embeddings=True)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)  # one batch, learned by heart

    with torch.no_grad():
        before = model(input_ids=ids, labels=ids).loss.item()
    coda.patch(model)
    print(f"patched {len(model.coda_patched)} modules; loss on the same weights: transformers {before:.4f}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
