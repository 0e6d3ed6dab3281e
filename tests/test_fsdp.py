"""coda.models.LlamaForCausalLM under FSDP2 (`fully_shard` per layer, then the model) on CPU with gloo.

Each run is a group of processes of this file (`python tests/test_fsdp.py --worker ...`, a FileStore
rendezvous: no port, no network) training a tiny model for two AdamW steps; the reference is one
unsharded process of the same file taking the ranks' batches one after another, accumulating their
gradients and dividing by the world size (what FSDP2's reduce-scatter averages). The losses and the
weights after the two steps must be bit-identical:
* every rank's forward sees the all-gathered parameters, which are copies of the reference's, on
  the same batch with the same kernels (every process runs with one thread), so each loss and
  each rank's gradient is the reference's microbatch gradient bit for bit;
* with two ranks the reduce-scatter's average `(g0 + g1) / 2` is one fp32 addition and an exact
  halving, as is the reference's; with one rank it is the gradient itself;
* AdamW (foreach=False on both sides) is elementwise, so a shard's update is the full tensor's
  restricted to it.
With MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) the reference does the same in a bf16
copy of its fp32 weights and accumulates the per-batch gradients in fp32, as FSDP2 does. Under
`torch.autocast` (bf16) with fp32 parameters and no FSDP2 policy, both sides run the same bf16 kernels
on casts of the same fp32 weights, and the gradients reach the fp32 parameters.
Last, bench/tools/train_fsdp.py --tiny under torchrun (2 ranks), whose own reference must agree exactly too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

# The ranks run on the CPU through Triton's interpreter, which (triton 3.6) fails under numpy 2.4 and
# later ("only 0-dimensional arrays can be converted to Python scalars"): the CPU suite pins numpy
# below 2.4, a GPU machine's image may not.
pytestmark = pytest.mark.skipif(numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0",
                                reason=f"the ranks need Triton's interpreter, which needs numpy < 2.4 "
                                       f"(this one has {numpy.__version__})")

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0)
STEPS, BATCH, SEQ = 2, 1, 16  # BATCH sequences per rank and step
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast": torch.float32}  # (autocast: fp32 parameters)


def autocast(dtype: str):
    """torch.autocast in bf16 for the "autocast" runs (a no-op context otherwise)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast")


def _child_env(**extra: str) -> dict[str, str]:
    """The environment of the processes these tests start: this checkout's coda first, and no GPU
    visible (the ranks run on the CPU, gloo and Triton's interpreter, on any machine: a GPU tier
    that let them see its GPU would put rank 1 on a device ordinal one GPU lacks, and CPU tensors
    into GPU kernels)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra,
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def make_model(tied: bool, checkpoint: bool):
    """The same model in every process (one seed), norms off 1 so that their gradients matter."""
    from coda.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tied), checkpoint=checkpoint,
                             initializer_range=0.2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens at `step` (labels = ids, a few ignored: the loss is a mean over the rest)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def run_sharded(world: int, tied: bool, checkpoint: bool, dtype: str, store: str, out: Path) -> None:
    """One rank of the FSDP2 run: shard per layer and the root, train, save losses and gathered weights."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = make_model(tied, checkpoint)
    # (under autocast no policy: FSDP2 would cast the layers' bf16 inputs to a param_dtype it is given)
    mp = MixedPrecisionPolicy() if dtype == "autocast" else MixedPrecisionPolicy(param_dtype=DTYPES[dtype],
                                                                                 reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step, rank)
        with autocast(dtype):
            loss = model(ids, labels=labels).loss
        loss.backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())  # reduce-scattered by FSDP2
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
    weights = model.to_hf_state_dict()  # a collective: every rank gathers
    torch.save({"losses": losses, "weights": weights}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_reference(world: int, tied: bool, checkpoint: bool, dtype: str, out: Path) -> None:
    """The unsharded run: per step, each rank's batch in turn on a `dtype` copy of the fp32 weights,
    gradients summed in fp32 and divided by `world`, AdamW on the fp32 weights."""
    master = make_model(tied, checkpoint=False)
    work = make_model(tied, checkpoint).to(DTYPES[dtype])
    opt = optimizer(master.parameters())
    losses = {r: [] for r in range(world)}
    for step in range(STEPS):
        with torch.no_grad():
            for w, p in zip(work.parameters(), master.parameters()):
                w.copy_(p)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for r in range(world):
            ids, labels = batch(step, r)
            with autocast(dtype):
                loss = work(ids, labels=labels).loss
            loss.backward()
            for acc, w in zip(grads, work.parameters()):
                acc += w.grad.float()
                w.grad = None
            losses[r].append(loss.detach().float())
        for p, acc in zip(master.parameters(), grads):
            p.grad = acc / world
        opt.step()
        opt.zero_grad()
    torch.save({"losses": losses, "weights": master.to_hf_state_dict()}, out / "reference.pt")


# -- the tests ---------------------------------------------------------------------------------

def _launch(tmp_path: Path, world: int, tied: bool, checkpoint: bool, dtype: str) -> dict:
    """Start the `world` ranks and the reference side by side, wait, return what they saved."""
    env = _child_env(OMP_NUM_THREADS="1")
    common = [sys.executable, __file__, "--world", str(world), "--dtype", dtype, "--out", str(tmp_path)]
    common += ["--tied"] * tied + ["--checkpoint"] * checkpoint
    procs = [subprocess.Popen(common + ["--reference"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    for rank in range(world):
        procs.append(subprocess.Popen(common + ["--store", str(tmp_path / "store")], env={**env, "RANK": str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        try:
            text, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, text.decode()[-4000:]
    return {name: torch.load(tmp_path / f"{name}.pt") for name in ["reference"] + [f"rank{r}" for r in range(world)]}


def _check(runs: dict, world: int, tied: bool) -> None:
    ref = runs["reference"]
    for r in range(world):
        torch.testing.assert_close(runs[f"rank{r}"]["losses"], ref["losses"][r], rtol=0, atol=0)
    mine, theirs = runs["rank0"]["weights"], ref["weights"]
    assert set(mine) == set(theirs)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=name)
    start = make_model(tied, checkpoint=False).to_hf_state_dict()
    moved = [name for name in start if not torch.equal(start[name], theirs[name])]
    assert moved == list(start)  # every weight took both steps (weight decay alone moves each one)


@pytest.mark.slow
def test_two_ranks_equal_unsharded_fp32_tied_checkpointed(tmp_path: Path) -> None:
    _check(_launch(tmp_path, 2, tied=True, checkpoint=True, dtype="fp32"), 2, tied=True)


@pytest.mark.slow
def test_one_rank_sharded_equals_unsharded_fp32(tmp_path: Path) -> None:
    _check(_launch(tmp_path, 1, tied=False, checkpoint=False, dtype="fp32"), 1, tied=False)


@pytest.mark.slow
def test_two_ranks_bf16_params_fp32_reduce_equal_reference(tmp_path: Path) -> None:
    _check(_launch(tmp_path, 2, tied=False, checkpoint=False, dtype="bf16"), 2, tied=False)


@pytest.mark.slow
def test_two_ranks_under_autocast_equal_reference(tmp_path: Path) -> None:
    """transformers' Trainer with bf16=True on fp32 weights: autocast around FSDP2's forward, checkpointed
    (the recomputation casts the gathered weights again)."""
    _check(_launch(tmp_path, 2, tied=True, checkpoint=True, dtype="autocast"), 2, tied=True)


@pytest.mark.slow
def test_train_fsdp_script_tiny_two_ranks_with_reference(tmp_path: Path) -> None:
    """bench/tools/train_fsdp.py --tiny under torchrun (2 gloo ranks, bf16 params, checkpointing): its
    progress lines and files, and its unsharded reference's losses equal to the sharded run's (the
    reference emulates FSDP2's mixed precision and averaging as above, so on the CPU exactly)."""
    root = Path(__file__).resolve().parents[1]
    env = _child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "bench" / "tools" / "train_fsdp.py"), "--tiny", "--steps", "1", "--warmup", "1", "--checkpoint",
           "--reference", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "[train_fsdp] step 2/2: loss" in proc.stdout and "[train_fsdp] reference step 2/2" in proc.stdout
    data = json.loads((tmp_path / "train_fsdp.json").read_text())
    r = data["result"]
    assert r["world"] == 2 and [s["timed"] for s in r["steps"]] == [False, True]
    assert r["tokens_per_s_per_gpu"] > 0 and r["peak_mem_gib"] > 0
    assert data["meta"]["param_dtype"] == "bfloat16" and data["meta"]["checkpoint"]
    assert len(data["reference"]["losses"]) == 2 and data["reference"]["max_abs_diff"] == 0
    assert all(3 < s["loss"] < 6 for s in r["steps"])  # about log(128) = 4.85 from a random init
    md = (tmp_path / "train_fsdp.md").read_text()
    assert "| 1 (warm-up) |" in md and "| 2 |" in md and "max |loss - reference| = 0" in md


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), required=True)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--store")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.reference:
        run_reference(a.world, a.tied, a.checkpoint, a.dtype, a.out)
    else:
        run_sharded(a.world, a.tied, a.checkpoint, a.dtype, a.store, a.out)
