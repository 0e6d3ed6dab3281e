"""Train coda's Llama model sharded with FSDP2 (torch.distributed.fsdp.fully_shard).

Each decoder layer is sharded, then the model: every rank holds a 1/N shard of the fp32 weights,
gradients and AdamW state; a layer's weights are all-gathered in bf16 for its forward and backward
(MixedPrecisionPolicy), and gradients are reduce-scattered in fp32. Each rank trains on its own batch.

    torchrun --standalone --nproc_per_node=2 examples/fsdp2_train.py            # tiny, CPU ranks (gloo)
    torchrun --standalone --nproc_per_node=8 examples/fsdp2_train.py --hidden 2048 --ffn 8192 --layers 16 \
        --heads 32 --kv-heads 8 --vocab 128256 --batch 2 --seq 4096              # Llama-3.2-1B's shape, 8 GPUs

On GPUs the ranks use NCCL, one GPU each; without a GPU, gloo and Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from coda.models import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, device=device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    for step in range(args.steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f} (mean over {world} ranks)", flush=True)
    dist.barrier()  # no rank tears gloo's connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
