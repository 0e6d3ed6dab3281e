"""The GPU benchmark scripts, run on tiny CPU shapes with a stub timer: every variant must
pass its fp32 correctness check, so the scripts do not rot between GPU sessions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "tools")]  # the scripts, and the investigation tools
harness = pytest.importorskip("harness")

from conftest import DEVICE, GPU, assert_close  # noqa: E402

# Every test here runs a benchmark script or its sm_90 compile: slow under the interpreter.
pytestmark = pytest.mark.slow


@pytest.fixture
def cpu_harness(monkeypatch: pytest.MonkeyPatch):
    """The scripts' tiny-shape run, on the test tier's device (the CPU under the interpreter)."""
    monkeypatch.setattr(harness, "DEVICE", str(DEVICE))
    monkeypatch.setattr(harness, "timed", lambda fn: (fn(), 1.0)[1])
    harness.ROWS.clear()
    harness.NOTES.clear()
    yield harness
    harness.ROWS.clear()
    harness.NOTES.clear()


def test_bench_holds_the_user_facing_scripts_and_gpu_session_names_existing_ones() -> None:
    """bench/'s top level is the user-facing benchmarks, their harness, gpu_session.sh and the results
    page (at most 8 scripts; investigation tools live in bench/tools/), and every script the GPU session
    runs exists."""
    import re

    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= 8, scripts
    named = set(re.findall(r"bench/[\w/]+\.(?:py|sh)", (BENCH / "gpu_session.sh").read_text()))
    assert {"bench/train.py", "bench/block_kernels.py", "bench/tools/profile_ops.py"} <= named
    assert [n for n in named if not (BENCH.parent / n).exists()] == []


def test_gemm_epilogues_script(cpu_harness) -> None:
    import gemm_epilogues as ge

    ge.bench_rmsnorm_gemm(ge.coda, None, m=40, d=32, ffn=24, modes=[])
    ge.bench_swiglu(ge.coda, None, m=40, d=32, ffn=24, modes=[])
    ge.bench_rope(ge.coda, None, 40, 128, modes=[], heads=4, kv_heads=2)
    ge.bench_residual_norm(ge.coda, None, m=40, d=32, ffn=48, modes=[])
    ge.bench_lm_head_ce(ge.coda, None, 40, 32, 70, modes=[])
    assert cpu_harness.NOTES == []
    assert len(cpu_harness.ROWS) == 5 * 4 and {r["variant"] for r in cpu_harness.ROWS} == {
        "cublas_gemm", "coda_gemm", "eager", "coda"}
    assert "| swiglu | 40 | 48 | 32 |" in ge.table(ge.summarize(cpu_harness.ROWS))


def test_ops_block_script(cpu_harness) -> None:
    import ops_block as ob

    ob._LIGER[:] = [None]
    ob.bench_rmsnorm_linear(40, 32, 48)
    ob.bench_swiglu_mlp(40, 32, 24)
    ob.bench_linear_ce(40, 32, 60)
    ob.bench_linear_ce_options(40, 32, 60)
    ob.bench_block(40, 64, 48, heads=4, kv=2)
    assert cpu_harness.NOTES == []
    coda_rows = [r for r in cpu_harness.ROWS if r["variant"] == "coda"]
    assert {r["op"] for r in coda_rows} == {f"{op}_{p}" for op in ob.OPS for p in ("fwd", "fwdbwd")}
    assert {r["op"] for r in cpu_harness.ROWS if r["variant"] == "coda_native_layout"} == {"block_fwd", "block_fwdbwd"}


def test_block_steps_return_both_outputs_apart_and_pass_their_checks(cpu_harness) -> None:
    """Each timed block step returns (x2, qkv) as two tensors (no copy into one tensor inside the
    timing, which SoL does not make either), and its check joins them for the fp32 reference."""
    import ops_block as ob

    ob._LIGER[:] = [None]
    steps = ob.block_steps(ob.block_case(40, 64, 48, heads=4, kv=2))
    assert set(steps) == {"coda_native", "eager", "coda"}
    for name, (step, check) in steps.items():
        result = step()
        x2, qkv = result[0]
        assert x2.shape == (40, 64) and qkv.shape == (40, (4 + 2 * 2) * 16), name
        assert check(result) < 2e-2, name


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger-Kernel's kernels need a CUDA GPU (its RMSNorm and SiLU-mul fail under the interpreter)")
def test_ops_block_liger_block(cpu_harness) -> None:
    """The Liger peer of the block (its RMSNorm, SiLU-mul and RoPE around cuBLAS) passes the fp32 check."""
    import ops_block as ob

    ob._LIGER.clear()
    ob.bench_block(256, 256, 512, heads=4, kv=2)
    assert cpu_harness.NOTES == []
    assert {r["op"] for r in cpu_harness.ROWS if r["variant"] == "liger"} == {"block_fwd", "block_fwdbwd"}


def test_host_overhead_script() -> None:
    """The host-time script runs (a few calls) and leaves no stubbed plan behind."""
    import host_overhead

    import coda
    from coda.runtime import launch

    times = host_overhead.measure(calls=3)
    assert set(times) == {"plain", "row_scale", "residual_norm_stats", "rmsnorm_backward_residual"}
    assert all(t > 0 for t in times.values())
    assert not launch._plans
    a = torch.randn(8, 16, device=DEVICE)
    b = torch.randn(16, 24, device=DEVICE)
    assert_close(coda.gemm(a, b), a @ b, a, b, "a real kernel after the script")


def test_block_kernels_script(cpu_harness) -> None:
    """Every GEMM of a tiny block, recorded and replayed on each backend: on the CPU the Triton
    replay passes its fp32 check and gluon-hopper is refused with its reason (the interpreter);
    on the H200 both backends pass it, and one of them is the runtime's choice."""
    import block_kernels as bk

    rows, swept = bk.kernel_rows(64, 48, 40, sweep=False, save=lambda rows, swept: None, heads=4, kv=2)
    assert [k.split(":")[1] for k in dict.fromkeys(r["kernel"] for r in rows)] == [
        "residual_norm_stats", "rms_swiglu", "residual_norm_stats", "rms_rope", "rmsnorm_backward_residual", "plain",
        "swiglu_backward_zdz", "plain", "rmsnorm_backward_residual", "plain", "plain", "plain"]
    assert all(r["err"] < 2e-2 for r in rows) and not swept
    if GPU:
        assert len(rows) == 24 and {r["backend"] for r in rows} == {"triton", "gluon-hopper"}
        assert sum(r["chosen"] for r in rows) == 12
    else:
        assert {r["backend"] for r in rows} == {"triton"} and all(r["chosen"] for r in rows)
        refused = [n for n in cpu_harness.NOTES if "gluon-hopper" in n]
        assert len(refused) == 12 and all("interpreter" in n for n in refused)
    md = bk.table({"rows": rows, "block": [{"D": 64, "variant": "coda", "ms": 1.0}]})
    assert "| 64 | fwd1:rms_swiglu | [40, 96, 64] |" in md and "| 64 | coda | 1.000 | - |" in md
    # a row is divided by the SoL timed just before it where the run recorded one, else by the median
    block = [{"D": 64, "variant": "sol_graph", "ms": 2.0}, {"D": 64, "variant": "coda", "ms": 3.0, "sol_ms": 2.5},
             {"D": 64, "variant": "eager", "ms": 3.0}]
    md = bk.table({"rows": [], "block": block})
    assert "| 64 | coda | 3.000 | 1.200 |" in md and "| 64 | eager | 3.000 | 1.500 |" in md


def test_block_kernels_takes_block_rows_from_a_fresh_process(cpu_harness, tmp_path, monkeypatch) -> None:
    """The full run starts `block_kernels.py --block-only D` per width and keeps what that process
    wrote, its notes too, also when it stopped early (a time limit), saying so."""
    import block_kernels as bk

    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        d = int(cmd[cmd.index("--block-only") + 1])
        rows = [{"D": d, "variant": "sol_graph", "ms": 1.0}]
        (tmp_path / f"block_d{d}.json").write_text(json.dumps({"block": rows, "notes": [f"child {d}"]}))
        return subprocess.CompletedProcess(cmd, 0 if d == 2048 else -9)

    monkeypatch.setattr(bk.subprocess, "run", fake_run)
    assert bk.fresh_block_rows(2048, 64, True, 300.4, tmp_path) == [{"D": 2048, "variant": "sol_graph", "ms": 1.0}]
    assert bk.fresh_block_rows(4096, 64, False, -5, tmp_path)[0]["D"] == 4096
    assert calls[0][1:] == [bk.__file__, "--block-only", "2048", "--m", "64", "--out", str(tmp_path), "--budget", "300"]
    assert calls[1][-3:] == ["--budget", "0", "--no-peers"]
    assert cpu_harness.NOTES == ["child 2048", "child 4096", "block D=4096: its process exited with -9 after 1 rows"]


def test_block_only_keeps_notes_made_after_its_last_row(cpu_harness, tmp_path, monkeypatch) -> None:
    """The child (`--block-only D`) writes its file once more at the end, so that a note made after
    its last row (a torch.compile peer skipped for time, or failed) reaches the parent."""
    import block_kernels as bk

    def fake_block_rows(d, f, m, peers, budget, save):
        rows = [{"D": d, "variant": "sol_graph", "ms": 1.0}]
        save(rows)
        cpu_harness.NOTES.append(f"block D={d} compile_max-autotune-no-cudagraphs: not run")
        return rows

    monkeypatch.setattr(bk, "block_rows", fake_block_rows)
    monkeypatch.setattr(bk.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bk.torch.cuda, "get_device_name", lambda: "fake")
    monkeypatch.setattr(sys, "argv", ["block_kernels.py", "--block-only", "4096", "--out", str(tmp_path)])
    bk.main()
    child = json.loads((tmp_path / "block_d4096.json").read_text())
    assert child == {"block": [{"D": 4096, "variant": "sol_graph", "ms": 1.0}],
                     "notes": ["block D=4096 compile_max-autotune-no-cudagraphs: not run"]}


def test_rowwise_script(cpu_harness) -> None:
    """bench/tools/rowwise_bandwidth.py at tiny shapes: every row pass passes its PyTorch check (the cross-entropy
    pass at the first width only) and gets its bandwidth ratio to torch.add."""
    import rowwise_bandwidth as bench_rowwise
    from coda.ops import rowwise

    rows = bench_rowwise.measure(m=8, widths={32: 48, 64: 96}, vocab=70)
    assert cpu_harness.NOTES == []
    assert [(r["D"], r["kernel"]) for r in rows] == [
        (32, "rope_backward"), (32, "rms_prep"), (32, "rms_input_grad"), (32, "rms_backward"), (32, "cross_entropy_"),
        (64, "rope_backward"), (64, "rms_prep"), (64, "rms_input_grad"), (64, "rms_backward")]
    assert all(r["err"] < 2e-2 and r["x_add"] > 0 for r in rows)
    assert "| 32 | cross_entropy_ |" in bench_rowwise.table(rows)
    swept = bench_rowwise.sweep(m=8, widths=(32,), tilings=bench_rowwise.TILINGS[:3])
    assert cpu_harness.NOTES == []
    assert [r["tiling"] for r in swept] == [list(t) for t in bench_rowwise.TILINGS[:3]]
    assert [r["default"] for r in swept] == [t == rowwise.rms_backward_tiling(32) for t in bench_rowwise.TILINGS[:3]]
    assert all(r["err"] < 2e-2 and r["x_add"] > 0 for r in swept)
    assert bench_rowwise.sweep_table(swept).count("\n| 32 | ") == 3


def test_import_time_script_sees_no_inductor_import_as_an_old_torch() -> None:
    """bench/tools/import_time.py times `import coda` in a fresh process as torch 2.11 (which needs the
    explicit Inductor fallbacks) and reports that the import left Inductor's lowering unloaded."""
    import import_time

    (run,) = import_time.measure("2.11.0", 1)
    assert run["s"] > 0 and run["inductor_loaded"] is False


def test_ncu_summary_reads_stall_reasons_and_hot_instructions() -> None:
    """bench/tools/ncu_summary.py on pages shaped like ncu's CSV exports (thousands separators, a units
    row, not-issued twins of each stall metric, columns found by name)."""
    import ncu_summary

    raw = [["ID", "Kernel Name", "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
            "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued", "smsp__pcsamp_warps_issue_stalled_barrier"],
           ["", "", "", "", ""], ["0", "coda_x", "3,000", "2,900", "1,000"]]
    assert ncu_summary.stall_shares(raw) == [("long_scoreboard", 0.75), ("barrier", 0.25)]
    assert ncu_summary.stall_shares(raw[:2]) == []  # no kernel row: nothing, not a guess
    source = [["# Address", "Source", "Warp Stall Sampling (All Samples)"], ["0x10", "LDG.E R2, [R4.64]", "1,234"],
              ["0x20", "FFMA R1, R2, R3, R1", "12"], ["0x30", "BAR.SYNC 0x0", "456"]]
    assert ncu_summary.hot_instructions(source, top=2) == [("LDG.E R2, [R4.64]", 1234.0), ("BAR.SYNC 0x0", 456.0)]
    assert ncu_summary.hot_instructions([["# Address", "Source"], ["0x10", "NOP"]]) == []
    spins = [["# Address", "Source", "Warp Stall Sampling (All Samples)"],
             ["0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR33+0x30458], R152", "1"], ["0x20", "@!P4  BRA 0x7f00", "800"],
             ["0x30", "@!P1  BRA 0x7f10", "50"], ["0x40", "FFMA R1, R2, R3, R1", "30"], ["0x50", "FFMA.FTZ R1, R2, R3, R1", "20"]]
    assert ncu_summary.by_opcode(spins) == [("wait [UR33+0x30458]", 800.0), ("BRA", 50.0), ("FFMA", 50.0),
                                            ("SYNCS", 1.0)]


def _gluon_source(name: str, **operand_dtypes: str) -> str:
    """The gluon-hopper source of a block epilogue, 32-column subtiles."""
    from coda.codegen import generate
    from coda.ops import epilogues as E
    from coda.runtime import aot

    graph = getattr(E, name).graph
    return generate(graph, aot.hopper_spec(graph, backend="gluon-hopper", subtile=4, operand_dtypes=operand_dtypes))


def test_timeline_instruments_the_generated_gluon_source() -> None:
    """bench/tools/timeline.py's text patch: five clock marks and the operand-wait sum in the consumer,
    the buffer threaded through; a template it does not recognize is an error, not a silent no-op."""
    import ast

    import timeline

    text = _gluon_source("residual_norm_stats", residual="bfloat16", norm_weight="bfloat16")
    out = timeline.instrument(text)
    ast.parse(out)
    assert out.count("%clock64") == 8  # t0..t4, and the zero, start and end of each operand wait
    assert out.count("gl.store(TL + ") == len(timeline.POINTS)
    assert "def _consumer(CID: gl.constexpr, TL, a_bufs," in out and out.count("(_consumer, (") == 2
    assert out.count("(_consumer, (0, TL, ") == 1 and out.count("(_consumer, (1, TL, ") == 1
    with pytest.raises(ValueError, match="template changed"):
        timeline.instrument(text.replace("mbarrier.wait(eturn.index(CID), turn_phase)", "pass"))
    # late_eturn moves the epilogue turn's handoff from after the ring wait of subtile HANDOFF (one
    # predicated arrive per subtile in the unrolled form) back to the tile's end
    assert text.count("mbarrier.arrive(eturn.index(1 - CID), count=1, pred=") == 4
    late = timeline.late_eturn(text)
    ast.parse(late)
    assert "pred=" not in late.split("def _consumer", 1)[1].split("eturn.index(1 - CID)", 1)[1].split("\n", 1)[0]
    assert late.count("mbarrier.arrive(eturn.index(1 - CID)") == 1
    assert late.index("mbarrier.arrive(eturn.index(1 - CID)") > late.index("tma.async_copy_shared_to_global")
    assert timeline.late_eturn(late) == late
    with pytest.raises(ValueError, match="no eturn handoff"):
        timeline.late_eturn(text.replace("mbarrier.arrive(eturn.", "mbarrier.arrive(turn."))
    ringless = _gluon_source("rms_rope")  # no epilogue ring: the handoff comes right after the turn
    assert ringless.count("mbarrier.arrive(eturn.index(1 - CID), count=1)\n") == 1
    late = timeline.late_eturn(ringless)
    assert late.index("mbarrier.arrive(eturn.index(1 - CID)") > late.index("tma.async_copy_shared_to_global")
    # exact_sigmoid swaps in Triton's sigmoid where the epilogue has one, and leaves others alone
    swiglu = _gluon_source("swiglu_backward_zdz", z="bfloat16")
    exact = timeline.exact_sigmoid(swiglu)
    ast.parse(exact)
    assert "_sigmoid = gluon.jit(_jh._sigmoid.fn)" in exact and timeline.exact_sigmoid(text) == text


@pytest.mark.skipif(GPU, reason="the CPU tier's check (the GPU tier runs the script itself)")
@pytest.mark.parametrize("variant", ["as_generated", "late_eturn", "exact_sigmoid"])
def test_timeline_kernels_compile_for_sm90(tmp_path: Path, variant: str) -> None:
    """The instrumented kernels compile for sm_90 under both schedules (bench/tools/timeline.py --aot)."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": str(BENCH.parent / "src")}
    env.pop("CODA_BACKEND", None)
    run = subprocess.run([sys.executable, str(BENCH / "tools" / "timeline.py"), "--aot", "--variant", variant], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("clock reads in the PTX") == 3


def test_timeline_table(tmp_path: Path) -> None:
    import json

    import timeline

    row = {"case": "plain_d", "D": 64, "label": "default", "gemm": [64, 64, 64], "tiles_per_consumer": 2.0,
           "config": "backend='gluon-hopper' block_m=128 block_n=256 num_stages=3 subtile=8 epi_stages=2 "
                     "store_buffers=1 epilogue_loop=False cooperative=True",
           "k_loop": 100.0, "ready_wait": None, "epilogue": 10.0, "turn_wait": 1.0, "eturn_wait": 2.0, "period": 120.0,
           "sm_span": 250.0}
    (tmp_path / "t.json").write_text(json.dumps([row]))
    timeline.merge([tmp_path / "t.json"], tmp_path / "out", 64, "a note")
    md = (tmp_path / "out" / "timeline_d64.md").read_text()
    schedule = "cooperative 128x256, 3 stages, subtile 8, e2 b1"
    assert f"| plain_d | [64, 64, 64] | default ({schedule}) | 2.0 | 100 | - | 10 |" in md
    assert "a note" in md


def test_timeline_summary_of_clock_records() -> None:
    """bench/tools/timeline.py's averages over [program][consumer][tile][point] clock records: unwritten
    tiles (zeros) and programs that ran nothing are left out."""
    import timeline

    empty = [0] * len(timeline.POINTS)
    records = [[[[10, 20, 50, 60, 70, 6], [80, 90, 120, 130, 150, 9], empty], [[15, 55, 85, 95, 110, 3], empty, empty]],
               [[empty] * 3, [empty] * 3]]
    assert timeline.summarize(records) == {
        "turn_wait": 20, "k_loop": 30, "eturn_wait": 10, "epilogue": 15, "ready_wait": 6, "period": 70,
        "tiles_per_consumer": 1.5, "sm_span": 140}


def test_epilogue_cost_cases(cpu_harness) -> None:
    """Every bench/tools/epilogue_cost.py case passes its fp32 check (tiny shapes, the Triton config)."""
    import epilogue_cost

    rows = epilogue_cost.measure(48, 32, 48, epilogue_cost.CASES, ["triton"])
    assert cpu_harness.NOTES == []
    assert sorted(r["case"] for r in rows) == sorted(epilogue_cost.CASES)
    assert all(r["err"] < 2e-2 for r in rows)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_graphed_replay_holds_the_tensors_its_graph_reads() -> None:
    """A replay must keep its captured closure's inputs alive: once freed, their memory is reused,
    or given back to the driver by the next capture, and the graph reads it anyway (the block's SoL
    graph once read freed inputs: wrong data, then an illegal address)."""
    import gc
    import weakref

    x = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(x)
    expected, held = x * 2, weakref.ref(x)
    replay = harness.graphed(lambda x=x: out.copy_(x * 2))
    del x
    gc.collect()
    assert held() is not None
    harness.graphed(lambda: torch.ones(4096, 4096, device="cuda"))  # a capture empties the allocator's cache
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_sol_stability_reads_the_gpu_state_and_tables_its_rounds(monkeypatch) -> None:
    """The GPU's state comes from one nvidia-smi line; each round is a row, coda against that round's SoL."""
    import sol_stability as ss

    def fake_smi(cmd, **kwargs):
        assert cmd[1] == f"--query-gpu={ss.SMI}"
        return subprocess.CompletedProcess(cmd, 0, stdout="1455, 684.89, 58, 700.00\n")

    monkeypatch.setattr(ss.subprocess, "run", fake_smi)
    state = ss.gpu_state()
    assert state == {"sm_mhz": 1455.0, "power_w": 684.89, "temp_c": 58.0, "power_limit_w": 700.0}
    row = {"D": 2048, "round": 1, "sol_kept_ms": 4.4, "sol_dropped_ms": 4.5, "sum_alone_ms": 4.35,
           "coda_native_ms": 4.84, "ratio_kept": 1.1, "coda_native_gpu": state}
    assert "| 2048 | 1 | 4.400 | 4.500 | 4.350 | 4.840 | 1.100 | 1455, 685, 58 |" in ss.table([row])


def test_measured_or_merged_reads_back_needs_a_gpu_and_seeds(cpu_harness, tmp_path, monkeypatch) -> None:
    """The scripts' one start: --merge reads the JSON back anywhere; measuring needs a GPU (else it
    exits saying so) and gives {"meta", **measure(), "notes"} after seeding."""
    (tmp_path / "m.json").write_text(json.dumps({"meta": {"commit": "x"}, "rows": [1], "notes": []}))
    merged = cpu_harness.measured_or_merged(tmp_path / "m.json", "s.py", "p", lambda: pytest.fail("measured"))
    assert merged == {"meta": {"commit": "x"}, "rows": [1], "notes": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="s.py measures on a CUDA GPU; --merge runs anywhere"):
        cpu_harness.measured_or_merged(None, "s.py", "p", lambda: pytest.fail("measured"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake")
    cpu_harness.NOTES.append("a note")
    data = cpu_harness.measured_or_merged(None, "s.py", "p", lambda: {"rows": [torch.rand(1).item()]})
    torch.manual_seed(0)
    assert data["rows"] == [torch.rand(1).item()] and data["notes"] == ["a note"]
    assert data["meta"]["gpu"] == "fake" and data["meta"]["protocol"] == "p"


def test_attention_script(cpu_harness) -> None:
    """The attention tool's checked variants on a tiny fp32 case (flash's needs bf16 on a GPU, FlexAttention a
    compile): the boolean mask against its fp32 self, the causal yardstick unchecked."""
    import attention as at

    cases = {"packed_window": (4, 2, 8, 5, "packed"), "window": (2, 1, 16, 3, "one"), "padded": (4, 2, 8, None, "padded")}
    rows = at.measure(batch=2, seq=32, cases=cases, variants=("sdpa_causal", "sdpa_mask"), dtype=torch.float32)
    assert cpu_harness.NOTES == []
    assert [(r["case"], r["variant"]) for r in rows] == [(c, v) for c in cases for v in ("sdpa_causal", "sdpa_mask")]
    assert all(r["error"] < 1e-6 for r in rows if r["variant"] == "sdpa_mask")
    assert "| packed_window | 4 / 2 x 8 | 5 | sdpa_mask |" in at.table(rows)


def test_compile_times_runs_random_programs_and_tables_them() -> None:
    """bench/tools/compile_times.py: a backend's fresh process runs the derandomized random programs, each
    checked against its fp32 reference with its first launch logged; the table counts errors and slow calls."""
    import compile_times

    assert compile_times.draw_programs(3, ((3, 16, 8),))[2][1].source() == \
        compile_times.draw_programs(3, ((3, 16, 8),))[2][1].source()  # the same programs every run
    run = compile_times.run_backend("triton", 2, 300, ((3, 16, 8),))
    assert run["stopped"] is None and len(run["rows"]) == 2
    assert all(r.get("correct") and r["first_call_s"] > 0 for r in run["rows"]), run["rows"]
    assert {x["backend"] for r in run["rows"] for x in r["launches"]} == {"triton"}
    slow = {"backend": "auto", "stopped": "timed out after 9 s",
            "rows": [{"first_call_s": 16.0}, {"first_call_s": 2.0}, {"error": "OutOfResources: 300000 B"}]}
    table = compile_times.table([run, slow])
    assert "| triton | 2 | 0 |" in table
    assert "| auto | 3 | 1 | 16.00 | 16.00 | 1 | timed out after 9 s |" in table


def test_attention_layout_table_compares_each_layout_with_codas() -> None:
    """bench/tools/attention_layout.py's table: each layout's forward + backward against coda's own at the
    same model and output-gradient layout."""
    import attention_layout

    rows = [{"model": "m", "layout": name, "grad": grad, "fwd_ms": 0.5, "fwd_bwd_ms": ms}
            for name, grad, ms in (("coda: slices of the fused QKV", "token-major", 2.0),
                                   ("coda: slices of the fused QKV", "head-major", 4.0),
                                   ("separate projections", "token-major", 1.0),
                                   ("separate projections", "head-major", 3.0))]
    table = attention_layout.table(rows)
    assert "| m | separate projections | token-major | 0.500 | 1.000 | 0.500 |" in table
    assert "| m | separate projections | head-major | 0.500 | 3.000 | 0.750 |" in table


def test_attention_in_step_variants_compute_codas_attention() -> None:
    """bench/tools/attention_in_step.py swaps coda's attention call for copies of q, k and v (and a
    head-major output gradient), SDPA's flash kernel and flash's variable-length one (on a GPU): each
    variant must train the same model, loss and gradients equal."""
    transformers = pytest.importorskip("transformers")
    import attention_in_step

    import coda.models.llama as llama

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = llama.from_hf(transformers.LlamaForCausalLM(config).to(DEVICE))
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    results = {}
    try:
        for name, attend in attention_in_step.variants(DEVICE).items():
            llama.attend = attend
            model.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    finally:
        llama.attend = attention_in_step.variants(DEVICE)["as_is"]
    loss, grads = results.pop("as_is")
    for name, (other, other_grads) in results.items():
        assert torch.allclose(other, loss, rtol=1e-6, atol=0), name
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(other_grads, grads)), name
