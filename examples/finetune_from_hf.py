"""Fine-tune a transformers model as coda's own model on documents of different lengths, then hand the
weights back to transformers.

The documents go in either padded (one per row, `attention_mask` marking the tokens) or packed (several
per row, `position_ids` restarting at 0 at each document: attention never crosses a document). Before
training, the coda model's loss is checked against transformers' on the same batch and weights; after
training, the weights go back into the transformers model (`to_hf_state_dict`), which then computes
the coda model's loss. `--loop trainer` trains with transformers' `Trainer` in place of the plain
PyTorch loop: it takes coda's model as it takes transformers' own (labels, gradient accumulation,
checkpointing); its checkpoints hold coda's layouts. `--save DIR` writes the trained model as a
transformers checkpoint (`model.save_pretrained`), which `from_pretrained` loads.

    python examples/finetune_from_hf.py                                  # Qwen3, tiny, padded: the CPU
    python examples/finetune_from_hf.py --family gemma3_text --batching pack
    python examples/finetune_from_hf.py --loop trainer --save /tmp/finetuned   # needs accelerate
    python examples/finetune_from_hf.py --family llama --hidden 2048 --ffn 8192 --layers 16 --heads 32 \\
        --kv-heads 8 --head-dim 64 --vocab 128256 --docs 16 --max-len 2048 --dtype bfloat16    # on a GPU

Without a CUDA GPU, coda runs its kernels through Triton's interpreter (tiny sizes only).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import coda
from coda.models.families import FROM_HF, supported

IGNORE = -100  # transformers' ignored label


def documents(n: int, max_len: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n random token sequences of 2 to max_len tokens (stand-ins for a tokenized dataset)."""
    lengths = torch.randint(2, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]


def padded(docs: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """One document a row, right-padded; pads are masked out of attention and the loss."""
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), pad_id)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for row, doc in enumerate(docs):
        ids[row, :len(doc)] = doc
        mask[row, :len(doc)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed(docs: list[torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The documents laid end to end and cut into `rows` rows of equal length (a document cut at a row's
    end goes on in the next row as a document of its own; the last few tokens are dropped). Positions
    restart at each document, and no document's first token is a target (it would be predicted from
    the previous document)."""
    ids, pos = torch.cat(docs), torch.cat([torch.arange(len(d)) for d in docs])
    width = len(ids) // rows
    ids, pos = ids[:rows * width].view(rows, width), pos[:rows * width].view(rows, width).clone()
    for row in pos:  # a row that starts inside a document: that part restarts at 0
        starts = (row == 0).nonzero()
        end = int(starts[0]) if len(starts) else width
        row[:end] -= int(row[0])
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, IGNORE)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3", choices=supported(FROM_HF), help="transformers model_type")
    ap.add_argument("--batching", choices=("pad", "pack"), default="pad")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--docs", type=int, default=6, help="documents a batch")
    ap.add_argument("--max-len", type=int, default=12, help="tokens a document at most")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--loop", choices=("torch", "trainer"), default="torch", help="a plain loop or transformers' Trainer")
    ap.add_argument("--save", help="save the trained transformers model here (save_pretrained)")
    args = ap.parse_args()
    for name in ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim", "docs", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_len < 2 or args.vocab < 2:
        ap.error("--max-len and --vocab must be at least 2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    config_class = transformers.CONFIG_MAPPING[args.family]
    head_dim = {"head_dim": args.head_dim} if "head_dim" in config_class().to_dict() else {}  # (Phi-3: hidden / heads)
    config = config_class(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                          pad_token_id=0, use_cache=False, **head_dim)  # no cache: transformers then masks packed documents
    # transformers' SDPA attention drops Gemma 2's score cap, which coda computes: compare with its eager attention
    attn = "eager" if getattr(config, "attn_logit_softcapping", None) is not None else None
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(getattr(torch, args.dtype))
    model = coda.models.from_hf(hf)  # the same weights in coda's fused layouts
    gen = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        docs = documents(args.docs, args.max_len, args.vocab, gen)
        b = padded(docs, config.pad_token_id) if args.batching == "pad" else packed(docs, max(1, args.docs // 3))
        return {k: v.to(device) for k, v in b.items()}

    first = batch()
    with torch.no_grad():
        theirs = hf(**first).loss.item()
        ours = model(first.pop("input_ids"), **first).loss.item()
    form = "padded" if args.batching == "pad" else "packed"
    print(f"{args.family}, {form} batch of {args.docs} documents: loss {ours:.4f} (transformers {theirs:.4f})")

    data = [batch() for _ in range(2)]  # two batches, learned by heart
    if args.loop == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        for step in range(args.steps):
            b = dict(data[step % 2])
            loss = model(b.pop("input_ids"), **b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"step {step}: loss {loss.item():.4f}")
    else:
        train_with_trainer(model, data, args)

    hf.load_state_dict(model.to_hf_state_dict())  # back to transformers' names and layouts
    b = dict(data[0])
    with torch.no_grad():
        theirs = hf(**b).loss.item()
        ours = model(b.pop("input_ids"), **b).loss.item()
    print(f"after training, transformers with the trained weights: loss {theirs:.4f} (coda {ours:.4f})")
    if args.save:
        model.save_pretrained(args.save)  # a transformers checkpoint: from_pretrained loads it
        print(f"saved the transformers model to {args.save}")


def train_with_trainer(model: torch.nn.Module, data: list[dict[str, torch.Tensor]], args: argparse.Namespace) -> None:
    """The same steps under transformers' Trainer: each dataset item is a whole batch, the constant
    learning rate and AdamW of the plain loop, each step's loss printed."""

    class PrintLoss(transformers.TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "loss" in logs:
                print(f"step {state.global_step - 1}: loss {logs['loss']:.4f}")

    with tempfile.TemporaryDirectory() as out:  # (Trainer's checkpoints, none saved here: save_strategy="no")
        config = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=1, learning_rate=args.lr,
            lr_scheduler_type="constant", weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[],
            disable_tqdm=True, use_cpu=not torch.cuda.is_available())
        trainer = transformers.Trainer(model=model, args=config, data_collator=lambda items: dict(items[0]),
                                       train_dataset=[data[i % 2] for i in range(args.steps)])
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.add_callback(PrintLoss())
        trainer.train()


if __name__ == "__main__":
    main()
