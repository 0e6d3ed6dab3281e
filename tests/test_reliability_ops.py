"""Issue 11, "no silent wrong answers": a correct result or a clear error for adversarial
input to the ops, the numerics of the epilogue primitives, empty shapes, and the code
generator's handling of names. Tiny shapes: every test runs under the interpreter."""

from __future__ import annotations

import pytest
import torch

import coda
from conftest import DEVICE, randn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _eye(n: int) -> torch.Tensor:
    return torch.eye(n, device=DEVICE)


# -- generated-code hygiene -----------------------------------------------------------------

def test_epilogue_name_with_newline_is_not_code() -> None:
    def fn(acc):
        return acc * 2

    fn.__name__ = "evil\nraise SystemExit('injected')\n#"
    ep = coda.epilogue(fn)
    a = randn(4, 4)
    src = ep.source(a, _eye(4))
    assert "\nraise SystemExit" not in src
    assert "def coda_evil_raise_SystemExit__injected____(" in src
    torch.testing.assert_close(coda.gemm(a, _eye(4), ep), 2 * a)


def test_non_ascii_epilogue_name_gives_an_ascii_kernel_name() -> None:
    def fn(acc):
        return acc + 1

    fn.__name__ = "größe"
    src = coda.epilogue(fn).source(randn(4, 4), _eye(4))
    assert "def coda_gr__e(" in src and "größe" not in src


def test_output_name_not_in_nfkc_form_is_rejected() -> None:
    def ligature(acc):
        return {"\ufb01": acc}  # "ﬁ", which Python reads as "fi"

    with pytest.raises(ValueError, match=r"output 'ﬁ' is not in NFKC normal form .*'fi'"):
        coda.epilogue(ligature)


def test_output_name_with_newline_is_rejected() -> None:
    def bad(acc):
        return {"y\nimport os": acc}

    with pytest.raises(ValueError, match=r"is not a valid name"):
        coda.epilogue(bad)


def test_colliding_argument_names_compile() -> None:
    """A Scalar `x_ptr` beside a vector `x` (and tile `x_s0` beside tile `x`) once both became
    the kernel argument `in_x_ptr` (`in_x_s0`): a SyntaxError."""

    @coda.epilogue
    def collide(acc, x: coda.VecM, x_ptr: coda.Scalar, t: coda.Tile, t_s0: coda.Scalar):
        return {"y": acc * x + x_ptr + t * t_s0, "y_r": coda.reduce_n(acc, "sum"), "y_r_max": coda.reduce_n(acc, "max")}

    a, b = randn(5, 6), randn(6, 8)
    ops = {"x": randn(5), "x_ptr": 1.5, "t": randn(5, 8), "t_s0": torch.tensor(-2.0, device=DEVICE)}
    out = coda.gemm(a, b, collide, **ops)
    ref = collide.reference(a, b, **ops)
    for name in ref:
        torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5)


def test_keyword_only_operands() -> None:
    @coda.epilogue
    def kw(acc, rstd: coda.VecM, *, s: coda.Scalar, g: coda.Tile):
        return acc * rstd * s + g

    assert [o.name for o in kw.graph.operands] == ["rstd", "s", "g"]
    a, b = randn(5, 6), randn(6, 8)
    ops = {"rstd": randn(5), "s": 3.0, "g": randn(5, 8)}
    torch.testing.assert_close(coda.gemm(a, b, kw, **ops), kw.reference(a, b, **ops), rtol=1e-5, atol=1e-5)


def test_keyword_only_accumulator_is_rejected() -> None:
    def kw_acc(*, acc):
        return acc

    with pytest.raises(TypeError, match=r"accumulator as its first parameter \(a positional one\)"):
        coda.epilogue(kw_acc)


def test_value_from_another_trace_as_output() -> None:
    leaked = []

    @coda.epilogue
    def leak(acc):
        leaked.append(acc * 2)
        return acc

    def returns_it(acc):
        return {"y": acc, "z": leaked[0]}

    def reduces_it(acc):
        return {"y": acc, "s": coda.reduce_n(leaked[0], "sum")}

    def computes_with_it(acc):
        return coda.exp(leaked[0])

    for fn in (returns_it, reduces_it):
        with pytest.raises(ValueError, match=r"output '[zs]' is a value from another epilogue's trace"):
            coda.epilogue(fn)
    with pytest.raises(ValueError, match=r"tracing has finished"):
        coda.epilogue(computes_with_it)
