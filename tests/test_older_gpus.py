"""GPUs before Hopper run the Triton backend: without TMA (Triton 3.6 emulates tensor descriptors
there with loads its pipeliner leaves unstaged, where pointer loads get cp.async stages), and
within the GPU's own shared memory (sm_80: 163 KiB a block, sm_86/89: 99 KiB, against sm_90's
227 KiB). Checked on the CPU: the specialization's choices with TMA off, the fit to a smaller
limit, and AOT compiles for sm_80 and sm_86 of the block's epilogues and of heavy grouped programs
at their defaults."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import coda
from coda.ops import epilogues as E
from coda.runtime import config, specialize, tma
from coda.runtime.resources import SharedMemory
from aot_worker import AotWorker, script
from cpu_calls import call as cpu_call
from test_resources import wide_programs

SM80, SM86 = 166912, 101376  # Triton's max_shared_mem on those GPUs


def test_without_tma_operands_and_outputs_go_through_pointers(monkeypatch) -> None:
    @coda.epilogue
    def f(acc, t: coda.Tile):
        return {"y": acc + t, "m": coda.reduce_n(acc, "max")}

    call = cpu_call(f.graph, 256, 512, 128)
    cfg = config.default_config(f.graph, "bfloat16", False, 256, 512, 128, "triton")
    hopper = specialize.specialize(call, False, cfg)
    assert (hopper.a_load, hopper.b_load, hopper.tma_tiles, hopper.tma_stores) == ("tma_row", "tma_col", ("t",), ("y",))
    monkeypatch.setattr(tma, "has_tma", lambda device: False)
    older = specialize.specialize(call, False, cfg)
    assert (older.a_load, older.b_load, older.tma_tiles, older.tma_stores) == ("ptr", "ptr", (), ())


def test_the_default_fits_the_gpus_limit() -> None:
    """The same call's default on sm_90 and under sm_86's limit: the smaller GPU's is smaller and fits it."""
    call = cpu_call(E.rms_swiglu.graph, 8192, 16384, 2048)
    need = lambda c: specialize.call_smem_bytes(call, c)  # noqa: E731
    hopper = config.default_config(call.graph, "bfloat16", False, 8192, 16384, 2048, "triton", SharedMemory(need))
    small = config.default_config(call.graph, "bfloat16", False, 8192, 16384, 2048, "triton", SharedMemory(need, SM86))
    assert need(hopper) > SM86 >= need(small)

    @coda.epilogue
    def grouped(acc, t: coda.Tile, u: coda.Tile(width=2)):
        return {"m": coda.reduce_n(acc + t, "max", group=512), "y": coda.interleave(acc, acc) + u}

    call = cpu_call(grouped.graph, 64, 8192, 64)
    need = lambda c: specialize.call_smem_bytes(call, c)  # noqa: E731
    assert need(config.default_config(call.graph, "bfloat16", False, 64, 8192, 64, "triton", SharedMemory(need))) \
        <= SharedMemory(need).limit
    with pytest.raises(ValueError, match=r"on this GPU: .*bytes of shared memory \(at most 101376 on this GPU\).*"
                                         r"groups of 512 columns.*it would fit with group <= 256"):
        config.default_config(call.graph, "bfloat16", False, 64, 8192, 64, "triton", SharedMemory(need, SM86))


WORKER = script('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    import coda
    from coda.ops import epilogues as E
    from coda.runtime import aot, config, specialize, tma
    from coda.runtime.resources import SharedMemory
    from cpu_calls import call as cpu_call

    tma.has_tma = lambda device: False  # the kernels of a GPU before Hopper
    compile_for_sm90 = triton.compile
    ARCH = {}

    def compile_for(src, target=None, options=None):
        return compile_for_sm90(src, target=GPUTarget("cuda", ARCH["arch"], 32), options=options)

    triton.compile = compile_for

    def handle(req):
        ARCH["arch"] = req["arch"]
        if "name" in req:
            graph = getattr(E, req["name"]).graph
        else:
            namespace = {"coda": coda}
            exec(req["source"], namespace)
            graph = coda.epilogue(namespace["f"]).graph
        m, n, k = req["shape"]
        call = cpu_call(graph, m, n, k)
        smem = SharedMemory(lambda c: specialize.call_smem_bytes(call, c), req["limit"])
        try:
            cfg = config.default_config(graph, "bfloat16", False, m, n, k, "triton", smem)
        except ValueError as exc:  # no config fits: the sentence
            return {"refused": str(exc)}
        r = aot.compile_call(call, cfg)
        return {"shared": r.shared, "model": smem(cfg), "cp_async": r.ptx.count("cp.async"),
                "tma": r.ptx.count("cp.async.bulk.tensor"), "config": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages}"}
''')

CASES = {
    "rms_swiglu": (8192, 16384, 2048),
    "residual_norm_stats": (8192, 2048, 8192),
    "swiglu_backward_zdz": (8192, 8192, 2048),
    "rmsnorm_backward_residual": (8192, 2048, 3072),
}
GROUPED = '''
def f(acc, t: coda.Tile, u: coda.Tile(width=2)):
    y = coda.interleave(acc, acc * 2.0) + u
    return {"y": y, "m": coda.reduce_n(acc + t, "max", group=128), "s": coda.reduce_n(acc, "sum", group=256)}
'''


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    with AotWorker(tmp_path_factory.mktemp("older_gpus"), WORKER, timeout_s=600) as w:
        yield w


@pytest.mark.slow
@pytest.mark.parametrize("arch,limit", [(80, SM80), (86, SM86)])
def test_defaults_compile_within_older_gpus_shared_memory_and_pipeline(worker: AotWorker, arch: int,
                                                                       limit: int) -> None:
    """Each default, fitted to the GPU's limit, compiles for it within that limit (the model an upper
    bound of the compile), pipelining its operand loads with cp.async and never through TMA."""
    for name, shape in [*CASES.items(), ("grouped", (128, 4096, 1024))]:
        req = {"arch": arch, "limit": limit, "shape": shape}
        req.update({"source": GROUPED} if name == "grouped" else {"name": name})
        r = worker.request(req, f"{name} on sm_{arch}: ")
        assert r["shared"] <= r["model"] <= limit, (name, r)
        assert r["cp_async"] > 0 and r["tma"] == 0, (name, r)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(source=wide_programs(), m=st.sampled_from([128, 1024]), n=st.sampled_from([2048, 4096]))
def test_random_wide_programs_fit_sm86(worker: AotWorker, source: str, m: int, n: int) -> None:
    """Random programs with many outputs, large groups, width-2 Tiles and pairs: the default fitted to
    sm_86's 99 KiB compiles for sm_86 within it, or no config fits and a sentence says which groups
    would (never an OutOfResources at launch)."""
    note(source)
    r = worker.request({"arch": 86, "limit": SM86, "shape": (m, n, 1024), "source": source})
    note(str(r))
    if "refused" in r:
        assert "on this GPU" in r["refused"] and "group <= " in r["refused"], r
        return
    assert r["shared"] <= r["model"] <= SM86, r
