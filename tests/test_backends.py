"""The two backends without compiling anything (in-process, fast).

* The primitive table: every primitive has a text in both dialects and a torch reference.
* gluon-hopper refuses what it cannot run (fp32 a/b, a/b that TMA cannot read, the interpreter)
  with a reason, and its generated source parses for every block epilogue and random programs,
  under the specialization the runtime makes.
* Backend choice on the CPU: `.source()` says why it is Triton; CODA_BACKEND is checked.
* Cache keys fail closed: the generator fingerprint is in the kernel key, and any change to a
  file under coda/ir, coda/codegen or coda/templates changes the fingerprint.
* Config refuses impossible gluon-hopper configs; the tuner's space holds both backends and its
  shared-memory pruning counts gluon-hopper's doubled staging.
"""

from __future__ import annotations

import ast
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings

import coda
from coda.codegen import generate, gluon_kernel, unsupported
from coda.epilogue import Epilogue
from coda.ir.nodes import StoreOutput
from coda.ir.primitives import BACKENDS, PRIMITIVES, REDUCTIONS
from coda.ir.types import Kind
from coda.ops import epilogues as E
from coda.runtime import autotune, cache, fingerprint, gluon_backend
from coda.runtime.aot import hopper_spec
from coda.runtime.config import GLUON_CONSUMERS, Config, default_config
from coda.runtime.gluon_backend import COOPERATIVE_MIN_K, store_bytes, tile_load_bytes
from coda.runtime.resources import BARRIER_BYTES, HOPPER_SMEM_BYTES, ring_bytes, staging_bytes
from coda.runtime.launch import PLAIN
from coda.runtime.specialize import make_spec, spec_fields
from coda.runtime.validate import validate
from conftest import DEVICE, EPS, GPU
from test_properties import Program, programs

cpu_only = pytest.mark.skipif(GPU, reason="checks the choice made without a GPU (Triton's interpreter)")

EPILOGUES: dict[str, Epilogue] = {ep.graph.name: ep for ep in vars(E).values() if isinstance(ep, Epilogue)}
EPILOGUES.update({ep.graph.name: ep for ep in (E.lm_head(d) for d in (torch.bfloat16, torch.float16, torch.float32))})
EPILOGUES.update({ep.graph.name: ep for ep in (E.lm_head(torch.bfloat16, softcap=c, smoothing=s)
                                                for c, s in ((True, False), (False, True), (True, True)))})
M, N, K = 256, 256, 128
INTERPRETER = "Gluon kernels do not run under Triton's interpreter"


def _zeros(graph, dtypes: dict[str, torch.dtype | None], m: int = M, n: int = N) -> dict[str, object]:
    """CPU operands of the right shapes (a Python number where the dtype is None)."""
    ops: dict[str, object] = {}
    for s in graph.operands:
        dtype = dtypes.get(s.name)
        if s.kind == Kind.SCALAR and dtype is None:
            ops[s.name] = 0.5
            continue
        cols = int(n * s.frac_width)
        shape = {Kind.SCALAR: (), Kind.VEC_M: (m,), Kind.VEC_N: (cols,), Kind.TILE: (m, cols)}[s.kind]
        ops[s.name] = torch.zeros(shape, dtype=dtype)
    return ops


def block_dtypes(graph) -> dict[str, torch.dtype | None]:
    """What a Llama block passes: Tile operands bf16, vectors fp32, targets and positions int64."""
    def dtype(s):
        if s.kind == Kind.SCALAR:
            return None
        if s.name in ("target", "pos"):
            return torch.int64
        return torch.bfloat16 if s.kind == Kind.TILE else torch.float32
    return {s.name: dtype(s) for s in graph.operands}


def runtime_gluon_spec(graph, operands: dict[str, object], *, in_dtype=torch.bfloat16, a_col=False, b_col=True,
                       k: int = K, n: int = N):
    """The gluon-hopper specialization the runtime makes for such a call on a GPU, and its config."""
    a = torch.zeros(k, M, dtype=in_dtype).T if a_col else torch.zeros(M, k, dtype=in_dtype)
    b = torch.zeros(n, k, dtype=in_dtype).T if b_col else torch.zeros(k, n, dtype=in_dtype)
    call = validate(graph, a, b, operands, None, True)
    cfg = default_config(graph, call.in_dtype, False, call.m, call.n, call.k, "gluon-hopper")
    return make_spec(spec_fields(call, False, cfg)), cfg


# -- primitives ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_every_primitive_has_both_texts_and_a_reference(name: str) -> None:
    prim = PRIMITIVES[name]
    assert set(prim.text) == set(BACKENDS), f"{name}: texts for {sorted(prim.text)}"
    args = ("xx", "yy")[:prim.arity]
    for backend in BACKENDS:
        text = prim.emit(backend, *args)
        assert "xx" in text and (prim.arity == 1 or "yy" in text), f"{name} ({backend}): {text!r}"
        ast.parse(text, mode="eval")
        assert "NS." not in text and ("gl." if backend == "triton" else "tl.") not in text.replace("tl.PropagateNan", "")
    assert callable(prim.reference)
    x = torch.tensor([0.5, 1.5, 2.0])
    ref = prim.reference(*([x] * prim.arity))
    assert ref.shape == x.shape and ref.dtype == (torch.bool if prim.result == "bool" else torch.float32)


def test_every_reduction_has_an_identity_in_both_dialects() -> None:
    for red in REDUCTIONS.values():
        assert isinstance(float(eval(red.identity)), float)  # noqa: S307 - a literal of our own table


# -- gluon-hopper's refusals -------------------------------------------------------------------

def test_gluon_refuses_the_interpreter_fp32_and_pointer_operands() -> None:
    graph = E.rms_swiglu.graph
    good = hopper_spec(graph, backend="gluon-hopper", subtile=2)
    assert gluon_kernel.unsupported(graph, good) is None
    cases = {
        "interpreter": (good.model_copy(update={"interpret": True}), "interpreter"),
        "fp32": (hopper_spec(graph, backend="gluon-hopper", in_dtype="float32", subtile=2), "fp32"),
        "pointer a": (hopper_spec(graph, backend="gluon-hopper", a_load="ptr", subtile=2), "a cannot be read by TMA"),
        "pointer b": (hopper_spec(graph, backend="gluon-hopper", b_load="ptr", subtile=2), "b cannot be read by TMA"),
    }
    for what, (spec, words) in cases.items():
        reason = gluon_kernel.unsupported(graph, spec)
        assert isinstance(reason, str) and words in reason, f"{what}: {reason!r}"
        assert unsupported(graph, spec) == reason  # codegen's dispatcher asks the backend
        with pytest.raises(ValueError, match="gluon-hopper backend"):
            generate(graph, spec)
        assert unsupported(graph, spec.model_copy(update={"backend": "triton"})) is None  # Triton runs everything


def test_runtime_spec_of_unaligned_operands_is_refused() -> None:
    """K = 36 bf16: a row-major a has a 72-byte row pitch, which TMA cannot read."""
    graph = E.row_scale.graph
    spec, _ = runtime_gluon_spec(graph, {"rstd": torch.zeros(M)}, k=36)
    assert spec.a_load == "ptr" and "a cannot be read by TMA" in unsupported(graph, spec)
    spec, _ = runtime_gluon_spec(graph, {"rstd": torch.zeros(M)}, k=36, a_col=True, b_col=False)
    assert (spec.a_load, spec.b_load) == ("tma_col", "tma_row") and unsupported(graph, spec) is None


# -- gluon-hopper's source parses ----------------------------------------------------------------

def _check_gluon_source(graph, spec) -> None:
    src = generate(graph, spec)
    ast.parse(src)
    assert "gl.warp_specialize" in src and "warpgroup_mma" in src and "coda_kernel = " in src
    for name in spec.tma_tiles:
        assert f"ering_{name}" in src
    for name in spec.tma_stores:
        assert f"stage_{name}" in src


@pytest.mark.parametrize("name", sorted(EPILOGUES) + ["plain"])
def test_gluon_source_parses_for_every_block_epilogue(name: str) -> None:
    graph = PLAIN if name == "plain" else EPILOGUES[name].graph
    spec, cfg = runtime_gluon_spec(graph, _zeros(graph, block_dtypes(graph)))
    assert spec.backend == "gluon-hopper" and spec.subtile == cfg.subtile
    assert unsupported(graph, spec) is None
    _check_gluon_source(graph, spec)
    for tma in (False, True):  # every Tile operand and store through pointers, or through TMA
        _check_gluon_source(graph, hopper_spec(graph, backend="gluon-hopper", operand_dtypes={
            s: (None if d is None else str(d).removeprefix("torch.")) for s, d in block_dtypes(graph).items()},
            tma_stores=tma, tma_tiles=tma, subtile=cfg.subtile))


@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_gluon_epilogue_loop_has_one_copy_of_the_epilogue(name: str) -> None:
    """With epilogue_loop, the subtiles run as one loop picking its accumulator slice: the
    epilogue's text appears once, not once a subtile."""
    graph = EPILOGUES[name].graph
    spec, _ = runtime_gluon_spec(graph, _zeros(graph, block_dtypes(graph)))
    spec = spec.model_copy(update={"subtile": 4, "epilogue_loop": False})
    unrolled = generate(graph, spec)
    looped = generate(graph, spec.model_copy(update={"epilogue_loop": True}))
    ast.parse(looped)
    assert "for h in range(SUBTILE):" in looped and "gl.where(h == 3, acc_3," in looped
    assert unrolled.count("epi_acc = acc_") == 4 and "epi_acc = acc_" not in looped
    assert looped.count("offs_n = off_n + gl.arange") == 1 and unrolled.count("offs_n = off_n + gl.arange") == 4


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(64, 64, 32))
def test_gluon_source_parses_for_random_programs(program: Program) -> None:
    note(program.source())
    graph = program.epilogue().graph
    spec, _ = runtime_gluon_spec(graph, _zeros(graph, {p.name: p.dtype for p in program.params}))
    note(repr(spec))
    assert unsupported(graph, spec) is None
    _check_gluon_source(graph, spec)


# -- backend choice on the CPU -------------------------------------------------------------------

@cpu_only
@pytest.mark.parametrize("name", ["row_scale", "rms_swiglu", "residual_norm_stats", "lm_head_stats"])
def test_source_says_triton_and_why(name: str) -> None:
    ep = EPILOGUES[name]
    ops = _zeros(ep.graph, block_dtypes(ep.graph), m=32, n=32)
    a, b = torch.zeros(32, 16, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    src = ep.source(a, b, **ops)
    first, _, rest = src.partition("\n")
    assert first == f"# coda backend: triton: {INTERPRETER}", first
    ast.parse(rest)
    assert "tl.dot" in rest and "gl." not in rest


@cpu_only
def test_forced_gluon_backend_raises_with_the_reason_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_BACKEND", "gluon-hopper")
    a, b = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"CODA_BACKEND=gluon-hopper.*{INTERPRETER}"):
        coda.gemm(a, b, E.row_scale, rstd=torch.rand(32))


def test_unknown_backend_setting_raises_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_BACKEND", "nonsense")
    device = "cuda" if GPU else "cpu"
    a, b = torch.randn(32, 16, device=device).bfloat16(), torch.randn(16, 32, device=device).bfloat16()
    with pytest.raises(ValueError, match="CODA_BACKEND.*'nonsense'"):
        coda.gemm(a, b)
    with pytest.raises(ValueError, match="CODA_BACKEND.*'nonsense'"):
        coda.gemm(a, b, E.row_scale, rstd=torch.rand(32, device=device))


# -- determinism: a race shows as a difference between launches ------------------------------------

def _random_operands(graph, m: int, n: int) -> dict[str, object]:
    """Block-like operands on the device: Tile operands bf16, vectors fp32 and positive (they
    include rstd), targets in [0, n), positions 0..m-1."""
    ops: dict[str, object] = {}
    for name, t in _zeros(graph, block_dtypes(graph), m, n).items():
        if not isinstance(t, torch.Tensor):
            ops[name] = t
        elif name == "target":
            ops[name] = torch.randint(0, n, t.shape, device=DEVICE)
        elif name == "pos":
            ops[name] = torch.arange(m, device=DEVICE)
        elif t.dtype == torch.float32:
            ops[name] = torch.rand(t.shape, device=DEVICE) + 0.5
        else:
            ops[name] = torch.randn(t.shape, device=DEVICE).to(t.dtype)
    return ops


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gluon-hopper", "triton"] if GPU else ["triton"])
@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_block_epilogues_are_deterministic(name: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same inputs launched again give bitwise the same outputs. Reductions are fixed-order
    partials and nothing is atomic, so a difference is a race: a staging buffer, ring slot or
    accumulator reused before its last reader finished. Short K and more tiles than consumers
    (on the GPU) keep the epilogues back to back, where such races live."""
    monkeypatch.setenv("CODA_BACKEND", backend)
    torch.manual_seed(0)
    m, n, k = (4096, 2048, 128) if GPU else (64, 64, 32)
    graph = EPILOGUES[name].graph
    a = torch.randn(m, k, device=DEVICE).bfloat16()
    b = (torch.randn(n, k, device=DEVICE) * k**-0.5).bfloat16().T
    ops = _random_operands(graph, m, n)
    assert EPILOGUES[name].source(a, b, **ops).startswith(f"# coda backend: {backend}")

    def outputs() -> dict[str, torch.Tensor]:
        out = coda.gemm(a, b, EPILOGUES[name], **ops)
        return out if isinstance(out, dict) else {"out": out}

    first = outputs()
    for launch in range(20 if GPU else 2):
        again = outputs()
        for key, t in first.items():
            same = (again[key] == t) | (again[key].isnan() & t.isnan())
            assert bool(same.all()), f"{name} on {backend}: output {key} differs at launch {launch + 2}"


COOPERATIVE = Config(backend="gluon-hopper", block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3,
                     subtile=8, cooperative=True)
PING_PONG = Config(backend="gluon-hopper", block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4, subtile=4)


@pytest.mark.skipif(not GPU, reason="gluon-hopper kernels run on a Hopper GPU")
@pytest.mark.parametrize("a_col", [False, True], ids=["a_row", "a_col"])
@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_cooperative_schedule_matches_ping_pong(name: str, a_col: bool) -> None:
    """Both consumers on one 128x256 tile (64 rows each) against ping-pong's 128x128 tiles (the
    backend the rest of the suite checks against the references), with M ragged so that the
    last tile's second row block is empty. Both take the same 32-column epilogue subtiles, so
    tile outputs and reductions over N agree to the last bit but for wgmma's own summation
    order (one bf16 ulp); reductions over M add 64- instead of 128-row partials (fp32 sums of M
    terms reordered). Relaunched, the cooperative kernel gives bitwise the same outputs (a race
    on its per-consumer rings would not)."""
    torch.manual_seed(0)
    m, n, k = 4096 + 40, 2048, 192
    graph = EPILOGUES[name].graph
    a = (torch.randn(k, m, device=DEVICE).bfloat16().T if a_col else torch.randn(m, k, device=DEVICE).bfloat16())
    b = (torch.randn(n, k, device=DEVICE) * k**-0.5).bfloat16().T
    ops = _random_operands(graph, m, n)

    def run(cfg: Config) -> dict[str, torch.Tensor]:
        out = coda.runtime.run(graph, a, b, ops, config=cfg)
        return out if isinstance(out, dict) else {graph.outputs[0].name: out}

    coop, ping = run(COOPERATIVE), run(PING_PONG)
    for o in graph.outputs:
        x, y = coop[o.name], ping[o.name]
        assert x.shape == y.shape and x.dtype == y.dtype, o.name
        if isinstance(o, StoreOutput):
            rtol = 2 * EPS[x.dtype]
        else:  # a reduction: fp32 sums of up to max(m, n) terms in another order
            rtol = max(m, n) * EPS[torch.float32]
        torch.testing.assert_close(x.float(), y.float(), rtol=rtol, atol=rtol * y.float().abs().max().item(),
                                   equal_nan=True, msg=lambda text: f"{name} output {o.name}: {text}")
    for launch in range(4):
        again = run(COOPERATIVE)
        for key, t in coop.items():
            same = (again[key] == t) | (again[key].isnan() & t.isnan())
            assert bool(same.all()), f"{name} cooperative: output {key} differs at launch {launch + 2}"


# -- cache keys fail closed ------------------------------------------------------------------------

def test_kernel_key_includes_the_generator_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = E.rms_swiglu.graph
    spec = hopper_spec(graph, backend="gluon-hopper", subtile=2)
    before = cache.kernel_key(graph, spec)
    assert cache.kernel_key(graph, spec) == before
    monkeypatch.setattr(cache, "GENERATOR", "0" * 16)
    assert cache.kernel_key(graph, spec) != before
    assert cache.kernel_key(graph, spec.model_copy(update={"backend": "triton"})) != cache.kernel_key(graph, spec)


def test_fingerprint_changes_with_any_generator_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the package's generator sources fingerprints as the package; editing, adding or
    removing any file under ir/, codegen/ or templates/ changes the fingerprint."""
    real = Path(fingerprint.__file__).resolve().parent.parent
    root = tmp_path / "coda"
    for pkg in ("ir", "codegen", "templates"):
        shutil.copytree(real / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "runtime").mkdir()
    monkeypatch.setattr(fingerprint, "__file__", str(root / "runtime" / "fingerprint.py"))
    base = fingerprint._compute()
    assert base == fingerprint.GENERATOR
    files = sorted(p for pkg in ("codegen", "templates", "ir") for p in (root / pkg).glob("*.py"))
    assert {p.name for p in files} >= {"gluon_kernel.py", "triton_kernel.py", "epilogue.py", "dialect.py",
                                        "gluon_hopper.py", "persistent_gemm.py", "primitives.py"}
    seen = {base}
    for path in files:
        text = path.read_bytes()
        path.write_bytes(text + b"\n# edited\n")
        changed = fingerprint._compute()
        assert changed not in seen, f"editing {path.relative_to(root)} left the fingerprint {changed}"
        seen.add(changed)
        path.write_bytes(text)
        assert fingerprint._compute() == base
    extra = root / "templates" / "new_template.py"
    extra.write_text("X = 1\n")
    assert fingerprint._compute() not in seen
    extra.unlink()
    (root / "codegen" / "names.py").unlink()
    assert fingerprint._compute() not in seen


# -- gluon-hopper configs ----------------------------------------------------------------------------

GOOD = dict(backend="gluon-hopper", block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)


@pytest.mark.parametrize("change, words", [
    ({"num_warps": 8}, "num_warps=4"),
    ({"num_warps": 2}, "num_warps=4"),
    ({"flatten": True}, "flatten=False"),
    ({"block_m": 256, "block_n": 64}, "block_m 64 or 128"),
    ({"block_m": 128, "block_n": 256}, "consumer\\) \\* block_n <= 16384"),
    ({"block_m": 64, "block_n": 512, "subtile": 2}, "consumer\\) \\* block_n <= 16384"),
    ({"block_m": 64, "block_n": 512, "subtile": 1}, "at most 256 columns"),
    ({"block_m": 128, "block_n": 512, "subtile": 2, "cooperative": True}, "consumer\\) \\* block_n <= 16384"),
    ({"block_m": 64, "block_n": 256, "cooperative": True}, "block_m 128 into the two"),
])
def test_config_refuses_impossible_gluon_configs(change: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Config(**{**GOOD, **change})
    tile = {key: v for key, v in change.items() if key != "cooperative"}
    Config(**{**GOOD, **tile, "backend": "triton"})  # the same tile is fine for Triton


def test_cooperative_tiles_split_their_rows_between_the_consumers() -> None:
    """A cooperative 128x256 tile is two 64x256 accumulators: the epilogue's boxes, staging and
    partials are 64 rows high, the operand ring holds the whole tile, the kernel gets SPLIT_M 2."""
    coop = Config(**{**GOOD, "block_n": 256, "subtile": 8, "cooperative": True})
    assert (coop.epi_m, coop.epi_n) == (64, 32) and (Config(**GOOD).epi_m, Config(**GOOD).epi_n) == (128, 128)
    assert staging_bytes(coop, Fraction(1), 2) == 64 * 32 * 2
    assert tile_load_bytes(coop, Fraction(1), 2) == 2 * coop.epi_stages * 64 * 32 * 2  # a ring per consumer
    assert ring_bytes(coop, 2) == coop.num_stages * (128 + 256) * 64 * 2
    assert gluon_backend.constexprs(coop, False, True)["SPLIT_M"] == 2
    assert gluon_backend.constexprs(Config(**GOOD), False, True)["SPLIT_M"] == 1


@pytest.mark.parametrize("change", [{"epi_stages": 4}, {"store_buffers": 2}, {"epilogue_loop": True},
                                    {"cooperative": True}])
def test_epilogue_pipelining_options_are_gluon_only(change: dict) -> None:
    assert Config(**{**GOOD, **change}).model_dump()[next(iter(change))] == next(iter(change.values()))
    with pytest.raises(ValueError, match="gluon-hopper options"):
        Config(**{**GOOD, **change, "backend": "triton", "num_warps": 8})


@pytest.mark.parametrize("change", [{"epi_stages": 0}, {"epi_stages": 9}, {"store_buffers": 3}])
def test_epilogue_pipelining_options_are_bounded(change: dict) -> None:
    with pytest.raises(ValueError):
        Config(**{**GOOD, **change})


def test_config_accepts_gluon_configs_within_limits() -> None:
    for change in ({}, {"block_m": 64, "block_n": 256, "subtile": 2}, {"block_m": 64, "block_n": 128},
                   {"subtile": 2}, {"block_n": 256, "block_m": 64}):
        assert Config(**{**GOOD, **change}).backend == "gluon-hopper"


@pytest.mark.parametrize("k", [4096, COOPERATIVE_MIN_K])
def test_gluon_defaults_are_valid_for_every_epilogue(k: int) -> None:
    for name, ep in {**EPILOGUES, "plain": None}.items():
        graph = PLAIN if ep is None else ep.graph
        cfg = default_config(graph, "bfloat16", False, 4096, 4096, k, "gluon-hopper")
        assert cfg.backend == "gluon-hopper" and cfg.num_warps == 4 and not cfg.flatten, name
        assert ring_bytes(cfg, 2) + gluon_backend.scratch_bytes(graph, cfg) <= HOPPER_SMEM_BYTES, name  # before staging


def test_gluon_default_schedule_follows_the_depth() -> None:
    """Cooperative for the plain GEMM at any K and for the block's epilogues from
    COOPERATIVE_MIN_K on; ping-pong (its epilogue hidden) below (at an output shape where the
    tile rounds do not decide it)."""
    def schedule(graph, k: int) -> bool:
        return default_config(graph, "bfloat16", False, 8192, 2048, k, "gluon-hopper").cooperative

    assert schedule(PLAIN, 64) and schedule(PLAIN, 2048)
    for name in ("residual_norm_stats", "rmsnorm_backward_residual", "rms_rope"):
        graph = EPILOGUES[name].graph
        assert not schedule(graph, 2048) and not schedule(graph, COOPERATIVE_MIN_K - 64), name
        assert schedule(graph, COOPERATIVE_MIN_K), name


def test_gluon_default_leaves_cooperative_only_for_clearly_fewer_tile_rounds() -> None:
    """The plain GEMM runs ping-pong where cooperative 128x256 tiles would leave the busiest of
    132 SMs clearly more work than 128x128 ones: [3072, 2048] has 192 cooperative tiles (2 rounds
    of 2 units) against 384 ping-pong ones (3 rounds of 1); equal or near rounds keep cooperative."""
    def cooperative(m: int, n: int, graph=PLAIN, k: int = 8192) -> bool:
        return default_config(graph, "bfloat16", False, m, n, k, "gluon-hopper").cooperative

    assert not cooperative(3072, 2048)
    assert not cooperative(3072, 2048, EPILOGUES["residual_norm_stats"].graph, COOPERATIVE_MIN_K)
    # 128 cooperative tiles: 1 round (2 units) against 2 ping-pong rounds (2 units, slower K loop)
    assert cooperative(2048, 2048)
    # every plain GEMM of the Llama block at D=2048 and 4096 but the first keeps cooperative
    for m, n in [(2048, 8192), (16384, 2048), (8192, 2048), (6144, 4096), (4096, 14336), (28672, 4096),
                 (8192, 4096), (4096, 4096)]:
        assert cooperative(m, n), (m, n)


def test_config_space_holds_both_backends() -> None:
    both = autotune.config_space("bfloat16", ("gluon-hopper", "triton"))
    gluon = [c for c in both if c.backend == "gluon-hopper"]
    triton = [c for c in both if c.backend == "triton"]
    assert gluon and triton and len(gluon) + len(triton) == len(both)
    assert gluon == autotune.config_space("bfloat16", ("gluon-hopper",))
    assert triton == autotune.config_space("bfloat16", ("triton",))
    assert all(c.num_warps == 4 and not c.flatten for c in gluon)
    assert len(set(both)) == len(both)
    assert autotune.config_space("bfloat16") == triton  # Triton only by default


@coda.epilogue
def _tile_in_tile_out(acc, g: coda.Tile):
    return acc + g


def test_prune_reason_counts_gluon_double_staging() -> None:
    """gluon-hopper keeps `epi_stages` slots per TMA Tile operand and `store_buffers` staging
    buffers per consumer: a 128x128 4-slot ring fits beside one of each for Triton (whose
    non-flattened epilogue stages its loads in the ring's bytes), not for gluon-hopper; more slots
    or buffers count in proportion."""
    graph = _tile_in_tile_out.graph
    gluon = Config(**GOOD)
    triton = Config(**{**GOOD, "backend": "triton", "num_warps": 8})
    staging = staging_bytes(gluon, Fraction(1), 2)
    assert staging_bytes(triton, Fraction(1), 2) == staging  # Triton stages one subtile of each
    assert tile_load_bytes(gluon, Fraction(1), 2) == gluon.epi_stages * staging == 2 * staging
    assert store_bytes(gluon, Fraction(1), 2) == GLUON_CONSUMERS * staging == 2 * staging
    deeper = gluon.model_copy(update={"epi_stages": 4, "store_buffers": 2})
    assert tile_load_bytes(deeper, Fraction(1), 2) == 4 * staging
    assert store_bytes(deeper, Fraction(1), 2) == 2 * GLUON_CONSUMERS * staging
    ring = ring_bytes(gluon, 2)
    assert autotune.smem_bytes(graph, triton, 2, 2) == ring + staging + BARRIER_BYTES <= HOPPER_SMEM_BYTES
    assert autotune.smem_bytes(graph, gluon, 2, 2) == ring + 4 * staging + BARRIER_BYTES > HOPPER_SMEM_BYTES
    assert autotune.prune_reason(graph, triton, 2, 2, 4096, 4096) is None
    reason = autotune.prune_reason(graph, gluon, 2, 2, 4096, 4096)
    assert reason is not None and "shared memory" in reason and str(ring + 4 * staging + BARRIER_BYTES) in reason
    # Without TMA stores only the Tile operand's ring is staged: it fits again.
    assert autotune.prune_reason(graph, gluon.model_copy(update={"tma_store": False}), 2, 2, 4096, 4096) is None
    # A plain GEMM with the same tile fits (one store staging per consumer).
    assert autotune.prune_reason(PLAIN, gluon, 2, 2, 4096, 4096) is None
