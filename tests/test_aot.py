"""Ahead-of-time compilation for Hopper (sm_90) of real epilogues, on any machine.

One fresh process (TRITON_INTERPRET=0, which compile_hopper needs even without a GPU)
compiles SwiGLU, an RMSNorm producer, cross-entropy and RoPE epilogues with the
production config, and reports for each: wgmma use and shared memory (from
`compile_hopper`'s result), registers and stack (from `cuobjdump --dump-resource-usage`,
which Triton ships, on the cubin) and spill bytes (from the `ptxas -v` log of the same
compile, which Triton prints with TRITON_DUMP_PTXAS_LOG=1). The cubin and the log come
from wrapping `triton.compile`, which `compile_hopper` calls.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda.runtime.aot import HOPPER_SMEM_BYTES

# Every test here compiles kernels for sm_90 in a fresh process: slow.
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import contextlib, io, json, re, subprocess, sys
    from pathlib import Path

    import triton
    import coda
    from coda.runtime.aot import compile_hopper, hopper_spec

    compiled = []  # (CompiledKernel, the ptxas -v log Triton prints with TRITON_DUMP_PTXAS_LOG=1)
    _compile = triton.compile


    def _capture(*args, **kwargs):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = _compile(*args, **kwargs)
        compiled.append((kernel, log.getvalue()))
        return kernel


    triton.compile = _capture


    @coda.epilogue
    def swiglu(acc, rstd: coda.VecM):
        z = acc * rstd
        gate, up = coda.pairs(z)
        return {"z": z, "y": coda.silu(gate) * up}


    @coda.epilogue
    def rmsnorm_producer(acc, res: coda.Tile, g: coda.VecN):
        x = acc + res
        return {"x": x, "h": x * g, "ss": coda.reduce_n(x * x, "sum")}


    @coda.epilogue
    def cross_entropy(acc, target: coda.VecM):
        hit = coda.where(coda.col_index() == target, acc, 0.0)
        return {"lse": coda.reduce_n(acc, "logsumexp"), "target_logit": coda.reduce_n(hit, "sum")}


    @coda.epilogue
    def rope(acc, pos: coda.VecM, inv_freq: coda.VecN(width=0.5)):
        x1, x2 = coda.pairs(acc)
        theta = pos * inv_freq
        cos, sin = coda.cos(theta), coda.sin(theta)
        return coda.interleave(x1 * cos - x2 * sin, x1 * sin + x2 * cos)


    CASES = {
        "swiglu": (swiglu, {}),
        "rmsnorm_producer": (rmsnorm_producer, {"res": "bfloat16"}),
        "cross_entropy": (cross_entropy, {"target": "int64"}),
        "rope": (rope, {"pos": "int32"}),
        "rope_default": (rope, {"pos": "int32"}),  # at the runtime's untuned config (128x256)
    }
    CONFIG = coda.Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
    DEFAULT = coda.runtime.default_config(rope.graph, "bfloat16", False, 8192, 3072, 2048)
    CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out_dir = Path(sys.argv[1])
    report = {}
    for name, (ep, dtypes) in CASES.items():
        cfg = DEFAULT if name.endswith("_default") else CONFIG
        result = compile_hopper(ep.graph, hopper_spec(ep.graph, operand_dtypes=dtypes), cfg)
        kernel, ptxas_log = compiled[-1]
        cubin = out_dir / f"{name}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        fields = dict(re.findall(r"(REG|STACK|LOCAL):(\\d+)", usage.split("Function coda_")[1]))
        spills = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", ptxas_log)
        report[name] = {
            "uses_wgmma": result.uses_wgmma, "shared": result.shared, "num_warps": result.num_warps,
            "registers": result.registers, "spills": result.spills,
            "cuobjdump": {key: int(value) for key, value in fields.items()},
            "ptxas_spill_bytes": [int(spills.group(1)), int(spills.group(2))],
            "ptx_local_bytes": sum(map(int, re.findall(r"__local_depot\\d+\\[(\\d+)\\]", kernel.asm["ptx"]))),
        }
    print(json.dumps(report))
''')

# rope_default: coda.sin/cos once took their quadrant mod 4 in fp32, and the 128x256 RoPE kernel
# then needed 278 KB of shared memory (an OutOfResources launch on the H200).
EPILOGUES = ("swiglu", "rmsnorm_producer", "cross_entropy", "rope", "rope_default")


def sm90_report(script: str, tmp: Path, *args: str, **env: str) -> dict:
    """Run `script` in a fresh process that compiles for sm_90 without a GPU (TRITON_INTERPRET=0,
    Triton's cache under `tmp`, `env` added) with `args`; the JSON its last line prints."""
    full = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "triton"), **env}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=full, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def aot_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Compile every epilogue for sm_90 in one fresh process; per-epilogue results."""
    tmp = tmp_path_factory.mktemp("aot")
    report = sm90_report(SCRIPT, tmp, str(tmp), TRITON_DUMP_PTXAS_LOG="1", CODA_CACHE_DIR=str(tmp / "coda"))
    print(json.dumps(report, indent=1))  # shown with pytest -s: the numbers behind the assertions
    return report


@pytest.mark.parametrize("name", EPILOGUES)
def test_compiles_for_hopper_with_wgmma_within_shared_memory(aot_report: dict[str, dict], name: str) -> None:
    result = aot_report[name]
    assert result["uses_wgmma"], f"{name}: no wgmma.mma_async in the PTX"
    assert result["num_warps"] == 8
    assert 0 < result["shared"] <= HOPPER_SMEM_BYTES, f"{name}: {result['shared']} bytes of shared memory"


@pytest.mark.parametrize("name", [e for e in EPILOGUES if not e.endswith("_default")])
def test_fits_in_registers_without_spills(aot_report: dict[str, dict], name: str) -> None:
    result = aot_report[name]
    usage = result["cuobjdump"]
    numbers = f"REG {usage['REG']}, STACK {usage['STACK']}, spill stores/loads {result['ptxas_spill_bytes']} bytes"
    assert 0 < usage["REG"] <= 255, f"{name}: {numbers}"
    assert result["ptxas_spill_bytes"] == [0, 0], f"{name} spills registers: {numbers}"
    # A stack frame may hold only local arrays the PTX declares itself (libdevice's sin/cos
    # range reduction keeps one), rounded up to 8 bytes; anything more would be spill slots.
    assert usage["STACK"] <= -(-result["ptx_local_bytes"] // 8) * 8 and usage["LOCAL"] == 0, f"{name}: {numbers}"


def test_rope_at_the_untuned_config_spills_no_more_than_measured(aot_report: dict[str, dict]) -> None:
    """Triton's 128x256 RoPE kernel (the untuned default) spills: 204 bytes at 2561dd3, 1212 since
    coda.sin/cos clamp their reduced argument (bounded results for huge |x|). The tuner drops
    spilling configs; this bound only keeps it from growing unnoticed."""
    assert aot_report["rope_default"]["ptxas_spill_bytes"][0] <= 1212


ROPE_PAIRS_SCRIPT = textwrap.dedent('''
    import json, re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from coda.ops.rowwise import _rope_pairs_kernel

    sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "bias_ptr": "*bf16", "pos_ptr": "*i64", "freq_ptr": "*fp32",
           "out_ptr": "*bf16", "zdz_ptr": "*fp32", "P": "i32", "stride_x": "i32", "stride_z": "i32", "stride_out": "i32",
           "INVERSE": "constexpr", "DOT": "constexpr", "BIAS": "constexpr", "BLOCK": "constexpr", "OUT": "constexpr",
           "RNE": "constexpr"}
    # what the JIT specializes a block-shaped launch to: aligned pointers, P and strides multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}
    counts = {}
    for name, inverse, dot, bias in (("backward", True, True, False), ("backward_bias", True, True, True),
                                     ("forward", False, False, False)):
        src = ASTSource(fn=_rope_pairs_kernel, signature=sig, attrs=attrs,
                        constexprs={"INVERSE": inverse, "DOT": dot, "BIAS": bias, "BLOCK": 256, "OUT": tl.bfloat16,
                                    "RNE": False})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 2}).asm["ptx"]
        counts[name] = {op: len(re.findall(re.escape(op) + r"\\b", ptx)) for op in
                        ("ld.global.v4", "ld.global.b16", "st.global.v4", "st.global.b16", "ld.local", "st.local")}
    print(json.dumps(counts))
''')


def test_rope_pairs_moves_16_byte_vectors_on_sm90(tmp_path) -> None:
    """The RoPE row pass (the block's RoPE backward: dz and z read, with Qwen2's bias too, and OLMo
    2's forward rotation: x read) loads and stores 16-byte vectors on sm_90 (PTX), not 2-byte
    scalars: what loading a pair's even and odd columns separately compiled to (64 scalar loads and
    32 scalar stores a thread at 0ef7040)."""
    counts = sm90_report(ROPE_PAIRS_SCRIPT, tmp_path)
    for name, loads in (("backward", 2), ("backward_bias", 3), ("forward", 1)):
        c = counts[name]
        assert c["ld.global.v4"] >= loads and c["st.global.v4"] >= 1, (name, c)
        assert c["ld.global.b16"] == c["st.global.b16"] == 0, (name, c)
        assert c["ld.local"] == c["st.local"] == 0, (name, c)


RMS_BACKWARD_SCRIPT = textwrap.dedent('''
    import json, re, subprocess, sys, tempfile
    from pathlib import Path
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from coda.ops.rowwise import _rms_backward_kernel, rms_backward_tiling

    CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "g_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
           "dg_ptr": "*fp32", "M": "i32", "D": "i32", "STEPS": "i32", "stride_dy": "i32", "stride_x": "i32",
           "stride_g": "i32", "stride_dx": "i32", "BLOCK": "constexpr", "R": "constexpr", "STAGES": "constexpr",
           "OUT": "constexpr", "RNE": "constexpr"}
    # what the JIT specializes the block's launch to: aligned pointers, sizes and strides multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 12)}
    report = {}
    for d in map(int, sys.argv[1:]):
        t = rms_backward_tiling(d)
        src = ASTSource(fn=_rms_backward_kernel, signature=sig, attrs=attrs,
                        constexprs={"BLOCK": triton.next_power_of_2(d), "R": t.rows, "STAGES": t.stages,
                                    "OUT": tl.bfloat16, "RNE": False})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": t.num_warps})
        cubin = Path(tempfile.mkdtemp()) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        report[d] = {key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL):(\\d+)", usage)}
    print(json.dumps(report))
''')


def test_rms_backward_default_tilings_do_not_spill_on_sm90(tmp_path) -> None:
    """rms_backward's default tilings (64 fp32 values a thread per tensor up to D=4096, one row at a
    time wider) compile for sm_90 without a stack frame: no register spills, as its docstring says."""
    report = sm90_report(RMS_BACKWARD_SCRIPT, tmp_path, "512", "2048", "4096", "8192")
    assert set(report) == {"512", "2048", "4096", "8192"}
    for d, usage in report.items():
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"D={d}: {usage}"


CROSS_ENTROPY_SCRIPT = textwrap.dedent('''
    import json, re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from coda.ops.rowwise import _cross_entropy_kernel

    sig = {"l_ptr": "*bf16", "target_ptr": "*i64", "scale_ptr": "*fp32", "lse_ptr": "*fp32", "tlogit_ptr": "*fp32",
           "V": "i32", "stride_l": "i32", "softcap": "fp32", "on_target": "fp32", "off_target": "fp32",
           "z_factor": "fp32", "BLOCK": "constexpr", "OUT": "constexpr", "RNE": "constexpr", "CAP": "constexpr",
           "SMOOTH": "constexpr", "ZLOSS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    report = {}
    for cap, smooth, zloss in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]:
        src = ASTSource(fn=_cross_entropy_kernel, signature=sig, attrs=attrs,
                        constexprs={"BLOCK": 4096, "OUT": tl.bfloat16, "RNE": False, "CAP": bool(cap),
                                    "SMOOTH": bool(smooth), "ZLOSS": bool(zloss)})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 8}).asm["ptx"]
        body = [line.strip() for line in ptx[ptx.index("{"):].splitlines()]
        report[f"{cap}{smooth}{zloss}"] = {"local": len(re.findall(r"\\.local\\b", ptx)),
                                           "instructions": sum(1 for line in body if line.endswith(";"))}
    print(json.dumps(report))
''')


def test_cross_entropy_row_pass_options_compile_on_sm90(tmp_path) -> None:
    """The cross-entropy row pass compiles for sm_90 at the block of a 128k vocabulary (4096
    columns, 8 warps) with each option alone and all together, without local memory (no spills),
    and each option's code is compiled in only when it is set: the plain kernel is the shortest
    (492 PTX instructions when the options came, one fewer than before them; CAP 779, SMOOTH 608,
    ZLOSS 510)."""
    report = sm90_report(CROSS_ENTROPY_SCRIPT, tmp_path)
    assert set(report) == {"000", "100", "010", "001", "111"}
    for flags, counts in report.items():
        assert counts["local"] == 0, f"CAP, SMOOTH, ZLOSS = {flags}: {counts}"
        if flags != "000":
            assert counts["instructions"] > report["000"]["instructions"], report


ROPE_HALVES_SCRIPT = textwrap.dedent('''
    import json, re, subprocess, sys, tempfile
    from pathlib import Path
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from coda.ops.rowwise import _rope_halves_kernel

    CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sig = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "HALF": "i32",
           "D": "i32", "stride_xt": "i32", "stride_xh": "i32", "stride_c": "i32", "stride_ot": "i32",
           "stride_oh": "i32", "BACKWARD": "constexpr", "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr",
           "BLOCK_PASS": "constexpr", "OUT": "constexpr", "RNE": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 8, 9, 10, 11)}
    report = {}
    for case in sys.argv[1:]:  # heads x half (+ pass-through columns), forward and backward
        h, half, rest = map(int, case.split("x"))
        for backward in (False, True):
            src = ASTSource(fn=_rope_halves_kernel, signature=sig, attrs=attrs,
                            constexprs={"BACKWARD": backward, "BLOCK_H": h, "BLOCK_HALF": half,
                                        "BLOCK_PASS": rest, "OUT": tl.bfloat16, "RNE": False})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
            cubin = Path(tempfile.mkdtemp()) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
            report[f"{case}/{'bwd' if backward else 'fwd'}"] = {
                key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL):(\\d+)", usage)}
    print(json.dumps(report))
''')


def test_rope_halves_compiles_without_spills_on_sm90(tmp_path) -> None:
    """coda.ops.rope's kernel (one token's heads a program) at the Llama-3.2-1B, Qwen3-1.7B and
    Gemma-3-1B q shapes and a Phi-3-like partial rotary, forward and backward: it compiles for sm_90
    and keeps everything in registers."""
    cases = ("32x32x0", "16x64x0", "4x128x0", "32x16x32")
    report = sm90_report(ROPE_HALVES_SCRIPT, tmp_path, *cases)
    assert len(report) == 2 * len(cases)
    for case, usage in report.items():
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"{case}: {usage}"
