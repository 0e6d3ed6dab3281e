"""A user's own epilogue under torch.compile(fullgraph=True), and coda.gemm from threads."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import coda
from conftest import DEVICE, assert_close, randn

M, N, K = 20, 24, 16


@coda.epilogue
def add(acc, g: coda.Tile):
    return acc + g


@coda.epilogue
def stats(acc, r: coda.VecM, s: coda.Scalar):
    return {"z": acc * r * s, "lse": coda.reduce_n(acc, "logsumexp"), "half": coda.pairs(acc)[0]}


def program(a, b, g, r):
    y = coda.gemm(a, b, add, g=g)
    o = coda.gemm(a, b, stats, r=r, s=0.5)
    acc = torch.zeros(M, N, device=a.device)
    coda.gemm(a, b, add, out=acc, g=acc)  # in place, through the custom op's mutation
    p = coda.gemm(a, b)
    return y.sin() + 1, o["z"], o["lse"], o["half"], acc, p


def _inputs():
    torch.manual_seed(0)
    return randn(M, K), randn(K, N), randn(M, N), torch.rand(M, device=DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_user_epilogue_fullgraph(backend):
    a, b, g, r = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(program, fullgraph=True, backend=backend)
    for got, want in zip(compiled(a, b, g, r), program(a, b, g, r)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, a, b, backend)


def test_compiled_out_dict_and_dynamic_shapes():
    a, b, g, r = _inputs()

    def f(a, b, r):
        z = torch.empty(a.shape[0], b.shape[1], device=a.device)
        o = coda.gemm(a, b, stats, out={"z": z}, r=r, s=2.0)
        return o["z"] + 0, o["lse"]

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for m in (M, 12):
        got, want = compiled(a[:m], b, r[:m]), f(a[:m], b, r[:m])
        for x, y in zip(got, want):
            assert_close(x, y, a, b, f"m={m}")


def test_compiled_errors_are_the_eager_ones():
    a, b, g, r = _inputs()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="operand 'g'"):
        torch.compile(lambda a, b: coda.gemm(a, b, add, g=torch.zeros(M, N + 2)), fullgraph=True,
                      backend="eager")(a, b)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not differentiable"):
        torch.compile(lambda a, b: coda.gemm(a, b), fullgraph=True, backend="eager")(a.requires_grad_(), b)


def test_custom_op_checks():
    a, b, g, r = _inputs()
    torch.library.opcheck(torch.ops.coda.gemm.default, (add._coda_signature[0], a, b, [0], [g], [], [], [torch.empty(M, N, device=DEVICE)]))


def test_threads():
    """Several threads calling coda.gemm at once (under the interpreter: one launch at a time)."""
    a, b, g, r = _inputs()
    want = add.reference(a, b, g=g)
    errors = []

    def work(i: int) -> None:
        try:
            for j in range(3):
                x = randn(M + i, K)  # distinct shapes: plans built concurrently
                assert_close(coda.gemm(x, b), x @ b, x, b, "plain")
                assert_close(coda.gemm(a, b, add, g=g), want, a, b, "add")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


LAZY_FALLBACKS_SCRIPT = """
import sys
import torch
torch.__version__ = torch.torch_version.TorchVersion("2.11.0")  # a torch that needs explicit fallbacks
import coda
from coda.runtime import inductor
waiting = {str(op) for op in inductor._pending}
assert "torch._inductor.lowering" not in sys.modules, "import coda imported Inductor"
assert {"coda.gemm.default", "coda.rmsnorm_fwd.default", "coda.rmsnorm_bwd.default"} <= waiting, waiting
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():  # what Dynamo and AOTAutograd do while tracing: run the fake kernels
    x, g = torch.empty(4, 8), torch.empty(8)
    coda.ops.rmsnorm(x, g)
from torch._inductor.lowering import lowerings
assert not inductor._pending
missing = [op for op in (torch.ops.coda.gemm.default, torch.ops.coda.rmsnorm_fwd.default) if op not in lowerings]
assert not missing, missing
print("ok", len(waiting))
"""


@pytest.mark.slow
def test_inductor_fallbacks_wait_for_the_first_trace(tmp_path):
    """On torch < 2.13 `import coda` does not import Inductor's lowering module (seconds): its ops
    wait, and the first fake-kernel call (tracing) registers every waiting op as a fallback."""
    proc = subprocess.run([sys.executable, "-c", LAZY_FALLBACKS_SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


@pytest.mark.slow
def test_explicit_inductor_fallbacks():
    """On torch < 2.13 coda registers its custom ops as explicit Inductor fallbacks when they are
    defined (runtime/inductor.py: that torch printed an implicit fallback's argument IR eagerly,
    which hung torch.compile of the coda Llama). This torch does not need them: register them
    here and check that Inductor still runs coda.gemm (in place too) and a differentiable op,
    forward and backward, as eager does."""
    from torch._inductor.lowering import lowerings

    from coda.runtime import inductor

    assert inductor.needs_explicit_fallbacks("2.11.0+cu130") and inductor.needs_explicit_fallbacks("2.12.1")
    assert not inductor.needs_explicit_fallbacks("2.13.0+cpu") and not inductor.needs_explicit_fallbacks("2.14.0")
    ops = [getattr(torch.ops.coda, name).default for name in ("gemm", "rmsnorm_fwd", "rmsnorm_bwd")]
    for op in ops:
        inductor.register_fallback(op)
        inductor.register_fallback(op)  # once
        assert op in lowerings

    a, b, g, r = _inputs()
    torch._dynamo.reset()
    for got, want in zip(torch.compile(program, fullgraph=True)(a, b, g, r), program(a, b, g, r)):
        assert_close(got, want, a, b, "coda.gemm")

    def norm(x, w):
        return (coda.ops.rmsnorm(x, w, 1e-6) ** 2).sum()

    x, w = randn(8, 32).requires_grad_(), randn(32).requires_grad_()
    want = norm(x, w)
    want_grads = torch.autograd.grad(want, (x, w))
    torch._dynamo.reset()
    got = torch.compile(norm, fullgraph=True)(x, w)
    got_grads = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, want)
    for gg, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(gg, wg)
