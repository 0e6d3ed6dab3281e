"""Does Gluon multicast a TMA load across a CTA cluster on sm_90? (compiles only; runs anywhere)

cuBLAS's GEMMs on the H200 read about a third fewer operand bytes than gluon-hopper's ping-pong,
because 2-CTA clusters load an operand once for both CTAs (TMA multicast). This compiles, for
sm_90 with two CTAs per cluster, a kernel whose TMA destination's shared layout is the same tile
in both CTAs (a broadcast CGA basis) and reports what the PTX does: whether the launch asks for
a cluster, and whether the `cp.async.bulk.tensor` load is `.multicast::cluster`.

    TRITON_INTERPRET=0 python bench/tools/probe_multicast.py
"""

from __future__ import annotations

import json
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def _load_tile(a_desc, out_ptr, BM: gl.constexpr, BK: gl.constexpr, LAYOUT: gl.constexpr):
    smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [0, 0], bar, smem)
    mbarrier.wait(bar, 0)
    x = smem.load(LAYOUT)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, LAYOUT))
    gl.store(out_ptr + rows[:, None] * BK + cols[None, :], x)


def probe(num_ctas: int = 2) -> dict:
    """PTX facts of the broadcast load with `num_ctas` CTAs per cluster."""
    cga = [[0, 0]] * (num_ctas.bit_length() - 1)  # every CTA bit maps to the same tile: broadcast
    shared = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=cga)
    regs = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=cga)
    sig = {"a_desc": f"tensordesc<bf16[128, 64],{shared!r}>", "out_ptr": "*bf16", "BM": "constexpr", "BK": "constexpr",
           "LAYOUT": "constexpr"}
    src = GluonASTSource(fn=_load_tile, signature=sig, constexprs={"BM": 128, "BK": 64, "LAYOUT": regs})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": num_ctas}).asm["ptx"]
    loads = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
    cluster = re.search(r"\.reqnctapercluster\s+(\d+)", ptx)
    return {"triton": triton.__version__, "num_ctas": num_ctas, "cluster_ctas": int(cluster.group(1)) if cluster else 1,
            "tma_loads": len(loads), "multicast_loads": sum(".multicast::cluster" in line for line in loads),
            "load": loads[0] if loads else None}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("probe_multicast.py compiles for sm_90: run it with TRITON_INTERPRET=0")
    print(json.dumps(probe(), indent=1))
