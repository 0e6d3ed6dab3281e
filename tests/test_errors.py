"""Invalid programs and inputs raise clear errors, before anything is launched.

Programs are rejected at decoration (`@coda.epilogue` traces immediately); inputs are
rejected by `coda.gemm` before a kernel runs, so a rejected call never writes into
its `out=` tensors.
"""

from typing import Callable

import pydantic
import pytest
import torch

import coda
from coda.ir import Graph
from coda.ir.nodes import ConstNode, InputNode, OperandSpec, PairNode, StoreOutput, UnaryNode
from coda.ir.types import Kind
from conftest import DEVICE, assert_close, randn

M, N, K = 19, 22, 27
CFG = coda.Config(block_m=16, block_n=16, block_k=16)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Deterministic inputs for every test."""
    torch.manual_seed(0)


# -- invalid programs: rejected when @coda.epilogue traces them --------------------------
# Plain (undecorated) functions; each test decorates one inside pytest.raises.

def unannotated(acc, x):
    return acc * x


def int_annotation(acc, x: int):
    return acc * x


def undefined_annotation(acc, x: "NoSuchType"):  # noqa: F821
    return acc * x


def width_mismatch(acc, h: coda.Tile(width=2)):
    return acc + h


def pairs_of_half_width(acc):
    even, _ = coda.pairs(acc)
    return coda.pairs(even)[0]


def pairs_of_vec_m(acc, r: coda.VecM):
    return acc * coda.pairs(r)[0]


def interleave_of_width_2(acc, h: coda.Tile(width=2)):
    return coda.interleave(h, h)


def interleave_tile_with_vec_n(acc, c: coda.VecN):
    return coda.interleave(acc, c)


def reduction_plus_one(acc):
    return coda.reduce_n(acc, "sum") + 1


def reduction_in_unary(acc):
    return coda.exp(coda.reduce_m(acc, "sum"))


def reduction_truth_value(acc):
    return acc if coda.reduce_n(acc, "max") else -acc


def if_on_value(acc):
    if acc > 0:
        return acc
    return -acc


def returns_none(acc):
    coda.exp(acc)


def returns_number(acc):
    return 1.0


def returns_tuple(acc):
    return acc, -acc


def returns_vec_m(acc, r: coda.VecM):
    return r * 2.0


def returns_scalar_in_dict(acc, s: coda.Scalar):
    return {"y": acc, "s": s + 1.0}


def returns_empty_dict(acc):
    return {}


def output_name_not_str(acc):
    return {1: acc}


def output_name_private(acc):
    return {"_y": acc}


def output_not_a_value(acc):
    return {"y": acc, "z": 0.0}


def reduce_n_mean(acc):
    return coda.reduce_n(acc, "mean")


def reduce_m_max(acc):
    return coda.reduce_m(acc, "max")


def group_not_power_of_two(acc):
    return coda.reduce_n(acc, "sum", group=3)


def group_not_int(acc):
    return coda.reduce_n(acc, "sum", group=4.0)


def group_sum_not_power_of_two(acc):
    return acc * coda.group_sum(acc, 6)


def group_sum_of_one(acc):
    return acc * coda.group_sum(acc, 1)


def group_max_not_int(acc):
    return coda.group_max(acc, 4.0)


def group_sum_of_vec_n(acc, w: coda.VecN):
    return acc * coda.group_sum(w, 2)


def group_sum_of_reduction(acc):
    return coda.group_sum(coda.reduce_n(acc, "sum"), 2)


def reduction_as_value_hint(acc):
    return acc * coda.reduce_n(acc * acc, "sum", group=4)


def reduce_of_vec_m(acc, r: coda.VecM):
    return {"y": acc, "s": coda.reduce_n(r, "sum")}


def reserved_out(acc, out: coda.Tile):
    return acc + out


def reserved_a(acc, a: coda.VecM):
    return acc * a


def private_name(acc, _r: coda.VecM):
    return acc * _r


def var_args(acc, *xs):
    return acc


def var_kwargs(acc, **kw):
    return acc


def with_default(acc, s: coda.Scalar = 1.0):
    return acc * s


def no_parameters():
    return None


def exp_of_tensor(acc):
    return acc + coda.exp(torch.ones(3))


def value_plus_tensor(acc):
    return acc + torch.ones(3)


def maximum_with_tensor(acc):
    return coda.maximum(acc, torch.zeros(3))


def where_of_numbers(acc):
    return acc + coda.where(1.0, 2.0, 3.0)


def col_index_bad_width(acc):
    return acc + coda.col_index(width=4)


PROGRAMS: list[tuple[Callable, type[Exception], str]] = [
    (unannotated, TypeError, r"parameter 'x' has no annotation"),
    (int_annotation, TypeError, r"parameter 'x' is annotated <class 'int'>"),
    (undefined_annotation, TypeError, r"cannot evaluate an annotation"),
    (width_mismatch, ValueError, r"add: cannot combine a tile of width 1 with a tile of width 2"),
    (pairs_of_half_width, ValueError, r"coda.pairs of a width-1/2 value"),
    (pairs_of_vec_m, TypeError, r"coda.pairs needs a value with columns .* got a vec_m"),
    (interleave_of_width_2, ValueError, r"coda.interleave of width-2 values would have width 4"),
    (interleave_tile_with_vec_n, ValueError, r"coda.interleave needs two values of the same kind"),
    (reduction_plus_one, TypeError, r"reduction \(reduce_n 'sum'\) is an output only"),
    (reduction_in_unary, TypeError, r"reduction \(reduce_m 'sum'\) is an output only"),
    (reduction_truth_value, TypeError, r"reduction \(reduce_n 'max'\) is an output only"),
    (if_on_value, TypeError, r"no truth value at trace time.*use coda.where"),
    (returns_none, TypeError, r"must return an epilogue value or a dict of them, got NoneType"),
    (returns_number, TypeError, r"must return an epilogue value or a dict of them, got float"),
    (returns_tuple, TypeError, r"must return an epilogue value or a dict of them, got tuple"),
    (returns_vec_m, TypeError, r"output 'out' is a vec_m; only tiles and reductions can be outputs"),
    (returns_scalar_in_dict, TypeError, r"output 's' is a scalar; only tiles and reductions"),
    (returns_empty_dict, ValueError, r"returned an empty dict"),
    (output_name_not_str, TypeError, r"output names must be strings, got 1"),
    (output_name_private, ValueError, r"output '_y' is not a valid name"),
    (output_not_a_value, TypeError, r"output 'z' is a float, not an epilogue value"),
    (reduce_n_mean, ValueError, r"reduce_n op must be one of .*got 'mean'"),
    (reduce_m_max, ValueError, r"reduce_m supports only \('sum',\), got 'max'"),
    (group_not_power_of_two, ValueError, r"group must be a positive power of two, got 3"),
    (group_not_int, TypeError, r"reduce_n group must be an int, got float"),
    (reduce_of_vec_m, TypeError, r"needs a tile, got a vec_m"),
    (group_sum_not_power_of_two, ValueError, r"coda.group_sum: the group size must be a power of two >= 2 .*got 6"),
    (group_sum_of_one, ValueError, r"coda.group_sum: the group size must be a power of two >= 2 .*got 1"),
    (group_max_not_int, TypeError, r"coda.group_max: the group size must be an int, got float"),
    (group_sum_of_vec_n, TypeError, r"coda.group_sum needs a tile \(groups of columns within each row\), got a vec_n"),
    (group_sum_of_reduction, TypeError, r"reduction \(reduce_n 'sum'\) is an output only.*coda.group_sum"),
    (reduction_as_value_hint, TypeError, r"is an output only.*for per-group statistics as values use coda.group_sum"),
    (reserved_out, ValueError, r"parameter name 'out' is reserved"),
    (reserved_a, ValueError, r"parameter name 'a' is reserved"),
    (private_name, ValueError, r"parameter '_r' is not a valid name"),
    (var_args, TypeError, r"\*args/\*\*kwargs are not supported"),
    (var_kwargs, TypeError, r"\*args/\*\*kwargs are not supported"),
    (with_default, TypeError, r"parameter 's' has a default"),
    (no_parameters, TypeError, r"must take the accumulator as its first parameter"),
    (exp_of_tensor, TypeError, r"coda.exp expects an epilogue value, got Tensor"),
    (value_plus_tensor, TypeError, r"add: epilogue values combine only with coda values and Python numbers, got Tensor"),
    (maximum_with_tensor, TypeError, r"maximum: epilogue values combine only with coda values and Python numbers"),
    (where_of_numbers, TypeError, r"coda.where needs at least one epilogue value"),
    (col_index_bad_width, ValueError, r"coda.col_index: width must be 1/2, 1 or 2, got 4"),
]


@pytest.mark.parametrize("fn, exc, match", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_invalid_program(fn: Callable, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        coda.epilogue(fn)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: coda.Tile(width=3), ValueError, r"coda.Tile: width must be 1/2, 1 or 2, got 3"),
    (lambda: coda.VecN(width=0.25), ValueError, r"coda.VecN: width must be 1/2, 1 or 2, got 0.25"),
    (lambda: coda.VecN(width="half"), ValueError, r"coda.VecN: width must be 1/2, 1 or 2, got 'half'"),
    (lambda: coda.Tile(width=True), TypeError, r"coda.Tile: width must be a number"),
    (lambda: coda.VecM(width=2), TypeError, r"coda.VecM has no width"),
    (lambda: coda.Scalar(width=0.5), TypeError, r"coda.Scalar has no width"),
], ids=["tile_width_3", "vec_n_width_quarter", "vec_n_width_str", "tile_width_bool", "vec_m_width", "scalar_width"])
def test_invalid_annotation(make: Callable[[], object], exc: type[Exception], match: str) -> None:
    """Bad operand annotations fail where they are written (at `def` time)."""
    with pytest.raises(exc, match=match):
        make()


def test_value_from_another_trace() -> None:
    leaked = []

    @coda.epilogue
    def leak(acc):
        leaked.append(acc)
        return acc

    def use_leaked(acc):
        return acc + leaked[0]

    with pytest.raises(ValueError, match=r"add: value from another epilogue's trace"):
        coda.epilogue(use_leaked)


@pytest.mark.parametrize("call, match", [
    (coda.row_index, r"coda.row_index\(\) is only available inside a @coda.epilogue function"),
    (coda.col_index, r"coda.col_index\(\) is only available inside a @coda.epilogue function"),
    (lambda: coda.exp(torch.ones(3)), r"coda.exp expects an epilogue value, got Tensor"),
    (lambda: coda.maximum(1.0, 2.0), r"coda.maximum works on epilogue values inside a @coda.epilogue function"),
    (lambda: coda.pairs(torch.ones(4)), r"coda.pairs expects an epilogue value, got Tensor"),
    (lambda: coda.reduce_n(torch.ones(4), "sum"), r"coda.reduce_n expects an epilogue value, got Tensor"),
], ids=["row_index", "col_index", "exp", "maximum", "pairs", "reduce_n"])
def test_primitive_outside_epilogue(call: Callable[[], object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        call()


# -- raw graphs: pydantic validation on construction -------------------------------------

ACC = InputNode(id=0, kind=Kind.TILE, name="acc")
VEC_M_R = (OperandSpec(name="r", kind=Kind.VEC_M),)
R = InputNode(id=1, kind=Kind.VEC_M, name="r")

GRAPHS: dict[str, tuple[dict, str]] = {
    "declared_kind_wrong": (
        dict(nodes=(ACC, UnaryNode(id=1, kind=Kind.VEC_M, fn="exp", x=0)), outputs=(StoreOutput(name="y", x=1),)),
        r"node %1 is declared vec_m\[1\] but its arguments make it tile\[1\]",
    ),
    "declared_width_wrong": (
        dict(nodes=(ACC, PairNode(id=1, kind=Kind.TILE, width="1", x=0, half=0)), outputs=(StoreOutput(name="y", x=1),)),
        r"node %1 is declared tile\[1\] but its arguments make it tile\[1/2\]",
    ),
    "dead_node": (
        dict(nodes=(ACC, ConstNode(id=1, kind=Kind.SCALAR, value=2.0)), outputs=(StoreOutput(name="y", x=0),)),
        r"nodes \[1\] are not used by any output",
    ),
    "arg_refers_to_later_node": (
        dict(nodes=(ACC, UnaryNode(id=1, kind=Kind.TILE, fn="exp", x=2), UnaryNode(id=2, kind=Kind.TILE, fn="neg", x=0)),
             outputs=(StoreOutput(name="y", x=1),)),
        r"node %1 uses %2, which is not an earlier node",
    ),
    "ids_out_of_order": (
        dict(nodes=(InputNode(id=1, kind=Kind.TILE, name="acc"),), outputs=(StoreOutput(name="y", x=1),)),
        r"node ids must be 0..n-1 in order, found id 1 at position 0",
    ),
    "output_of_missing_node": (
        dict(nodes=(ACC,), outputs=(StoreOutput(name="y", x=0), StoreOutput(name="z", x=5))),
        r"output 'z' refers to missing node %5",
    ),
    "no_outputs": (dict(nodes=(ACC,), outputs=()), r"an epilogue must have at least one output"),
    "duplicate_output": (
        dict(nodes=(ACC,), outputs=(StoreOutput(name="y", x=0), StoreOutput(name="y", x=0))),
        r"output 'y' appears twice",
    ),
    "undeclared_operand": (
        dict(nodes=(ACC, InputNode(id=1, kind=Kind.VEC_M, name="r")), outputs=(StoreOutput(name="y", x=0),)),
        r"input node refers to undeclared operand 'r'",
    ),
    "operand_declared_twice": (
        dict(operands=VEC_M_R * 2, nodes=(ACC,), outputs=(StoreOutput(name="y", x=0),)),
        r"operand 'r' is declared twice",
    ),
    "vec_m_with_width": (
        dict(operands=(OperandSpec(name="r", kind=Kind.VEC_M, width="2"),), nodes=(ACC,), outputs=(StoreOutput(name="y", x=0),)),
        r"operand 'r': a vec_m has no width",
    ),
    "single_with_two_outputs": (
        dict(nodes=(ACC,), outputs=(StoreOutput(name="y", x=0), StoreOutput(name="z", x=0)), single=True),
        r"a single-output graph must have exactly one output",
    ),
    "store_of_vec_m": (
        dict(operands=VEC_M_R, nodes=(ACC, R), outputs=(StoreOutput(name="y", x=0), StoreOutput(name="z", x=1))),
        r"output 'z' is a vec_m; only tiles and reductions can be outputs",
    ),
    "pair_of_vec_m": (
        dict(operands=VEC_M_R, nodes=(ACC, R, PairNode(id=2, kind=Kind.VEC_M, x=1, half=0)),
             outputs=(StoreOutput(name="y", x=0), StoreOutput(name="z", x=2))),
        r"coda.pairs needs a value with columns",
    ),
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_invalid_graph(name: str) -> None:
    """A hand-built Graph is validated on construction; every rejection is a ValidationError."""
    fields, match = GRAPHS[name]
    with pytest.raises(pydantic.ValidationError, match=match):
        Graph(**{"name": "g", "operands": (), **fields})


def test_graph_from_json_unknown_node_family() -> None:
    data = {"name": "g", "operands": [], "nodes": [{"family": "bogus", "id": 0}], "outputs": []}
    with pytest.raises(pydantic.ValidationError, match=r"Input tag 'bogus' found using 'family'"):
        Graph.model_validate(data)


# -- invalid inputs: rejected by coda.gemm ----------------------------------------------

@coda.epilogue
def affine(acc, r: coda.VecM, c: coda.VecN, t: coda.Tile, s: coda.Scalar):
    return acc * r + c + t * s


def affine_call() -> dict[str, object]:
    """Valid arguments for coda.gemm(a, b, affine, ...); cases below break one thing."""
    return dict(a=randn(M, K), b=randn(K, N), epilogue=affine, r=randn(M), c=randn(N), t=randn(M, N), s=0.5)


def gemm_call(kw: dict[str, object]) -> object:
    """coda.gemm with the arguments in `kw`."""
    kw = dict(kw)
    return coda.gemm(kw.pop("a"), kw.pop("b"), kw.pop("epilogue"), **kw)


def _set(**changes: object) -> Callable[[dict], None]:
    """A case that replaces arguments; values may be functions of the valid arguments."""
    def apply(kw: dict) -> None:
        kw.update({k: v(kw) if callable(v) else v for k, v in changes.items()})
    return apply


def _drop(name: str) -> Callable[[dict], None]:
    return lambda kw: kw.pop(name)


def plain_function(acc):
    return acc


INPUTS: dict[str, tuple[Callable[[dict], None], type[Exception], str]] = {
    "a_not_2d": (_set(a=lambda kw: kw["a"][0]), ValueError, r"coda.gemm: a must be 2-D, got shape \(27,\)"),
    "b_3d": (_set(b=lambda kw: kw["b"][None]), ValueError, r"coda.gemm: b must be 2-D, got shape \(1, 27, 22\)"),
    "a_not_tensor": (_set(a=lambda kw: kw["a"].tolist()), TypeError, r"coda.gemm: a must be a torch.Tensor, got list"),
    "k_mismatch": (_set(b=lambda kw: randn(K + 1, N)), ValueError, r"a is \[M, K\] = \[19, 27\] but b is \[K, N\] = \[28, 22\]; K differs"),
    "dtype_mismatch": (_set(b=lambda kw: kw["b"].bfloat16()), ValueError, r"a is torch.float32 but b is torch.bfloat16"),
    "float64": (_set(a=lambda kw: kw["a"].double(), b=lambda kw: kw["b"].double()), TypeError, r"a has dtype torch.float64; supported: float16, bfloat16, float32"),
    "int_inputs": (_set(a=lambda kw: kw["a"].int(), b=lambda kw: kw["b"].int()), TypeError, r"a has dtype torch.int32"),
    "missing_operand": (_drop("r"), TypeError, r"epilogue 'affine' is missing operand\(s\): r \(VecM\)"),
    "unknown_operand": (_set(q=lambda kw: randn(M)), TypeError, r"got unknown operand\(s\) 'q'; it takes: r, c, t, s"),
    "vec_m_wrong_length": (_set(r=lambda kw: randn(M + 1)), ValueError, r"operand 'r' \(VecM\) must have shape \[19\], got \[20\]"),
    "vec_m_as_column": (_set(r=lambda kw: randn(M, 1)), ValueError, r"operand 'r' \(VecM\) must have shape \[19\], got \[19, 1\]"),
    "vec_n_wrong_length": (_set(c=lambda kw: randn(M)), ValueError, r"operand 'c' \(VecN\) must have shape \[22\], got \[19\]"),
    "tile_transposed_shape": (_set(t=lambda kw: randn(N, M)), ValueError, r"operand 't' \(Tile\) must have shape \[19, 22\], got \[22, 19\]"),
    "scalar_1d_tensor": (_set(s=lambda kw: randn(1)), ValueError, r"operand 's' \(Scalar\) must have shape \[\], got \[1\]"),
    "scalar_string": (_set(s="0.5"), TypeError, r"operand 's' \(Scalar\) must be a Python number or a 0-d tensor, got str"),
    "scalar_bool": (_set(s=True), TypeError, r"operand 's' \(Scalar\) must be a Python number or a 0-d tensor, got bool"),
    "vec_m_list": (_set(r=lambda kw: [1.0] * M), TypeError, r"operand 'r' \(VecM\) must be a torch.Tensor, got list"),
    "vec_n_float64": (_set(c=lambda kw: kw["c"].double()), TypeError, r"operand 'c' \(VecN\) has dtype torch.float64"),
    "operand_other_device": (_set(t=lambda kw: torch.empty(M, N, device="meta")), ValueError, r"operand 't' \(Tile\) is on meta"),
    "out_wrong_shape": (_set(out=lambda kw: torch.empty(M, N + 1, device=DEVICE)), ValueError, r"out\['out'\] must have shape \[19, 22\], got \[19, 23\]"),
    "out_unknown_name": (_set(out=lambda kw: {"y": torch.empty(M, N, device=DEVICE)}), ValueError, r"out= names 'y', which is not an output of 'affine' \(out\)"),
    "out_list": (_set(out=lambda kw: [torch.empty(M, N, device=DEVICE)]), TypeError, r"out= must be a tensor or a dict of tensors, got list"),
    "out_value_not_tensor": (_set(out={"out": 0.0}), TypeError, r"out\['out'\] must be a tensor, got float"),
    "out_float64": (_set(out=lambda kw: torch.empty(M, N, dtype=torch.float64, device=DEVICE)), TypeError, r"out\['out'\] has dtype torch.float64"),
    "epilogue_plain_function": (_set(epilogue=lambda kw: plain_function), TypeError, r"epilogue must be a @coda.epilogue function or None, got function"),
    "epilogue_string": (_set(epilogue="affine"), TypeError, r"epilogue must be a @coda.epilogue function or None, got str"),
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_invalid_input(name: str) -> None:
    breaks, exc, match = INPUTS[name]
    kw = affine_call()
    breaks(kw)
    with pytest.raises(exc, match=match):
        gemm_call(kw)


def test_mixed_dtypes_under_autocast_say_coda_does_not_autocast() -> None:
    kw = affine_call()
    kw["b"] = kw["b"].bfloat16()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16), \
            pytest.raises(ValueError, match=r"torch.autocast is on, and coda's ops do not autocast"):
        gemm_call(kw)


def test_affine_call_is_valid() -> None:
    """The baseline the cases above break one thing of is itself accepted."""
    kw = affine_call()
    ref = affine.reference(**{k: v for k, v in kw.items() if k != "epilogue"})
    assert_close(gemm_call(kw), ref, kw["a"], kw["b"], "baseline affine call")


def test_reference_validates_too() -> None:
    """The oracle rejects what the kernel rejects (here a missing operand)."""
    kw = affine_call()
    del kw["epilogue"], kw["c"]
    with pytest.raises(TypeError, match=r"missing operand\(s\): c \(VecN\)"):
        affine.reference(**kw)


@coda.epilogue
def swiglu(acc):
    gate, up = coda.pairs(acc)
    return coda.silu(gate) * up


@coda.epilogue
def half_scale(acc, w: coda.VecN(width=0.5)):
    return coda.pairs(acc)[0] * w


@coda.epilogue
def head_sums(acc):
    return coda.reduce_n(acc, "sum", group=4)


@coda.epilogue
def wide_head_sums(acc):
    return coda.reduce_n(acc, "sum", group=32)


@coda.epilogue
def head_norm(acc):
    return acc * coda.rsqrt(coda.group_sum(acc * acc, 32) + 1.0)


@coda.epilogue
def half_head_max(acc):
    even, _ = coda.pairs(acc)
    return {"y": acc, "m": coda.group_max(even, 16)}


@coda.epilogue
def two_outputs(acc):
    return {"y": acc * 2.0, "s": coda.reduce_n(acc, "sum")}


def test_pairs_need_even_n() -> None:
    with pytest.raises(ValueError, match=r"epilogue 'swiglu' uses pairs or width-1/2 values, so N must be even; got N=21"):
        coda.gemm(randn(M, K), randn(K, 21), swiglu)


def test_half_width_operand_needs_even_n() -> None:
    with pytest.raises(ValueError, match=r"epilogue 'half_scale' uses pairs or width-1/2 values, so N must be even; got N=21"):
        coda.gemm(randn(M, K), randn(K, 21), half_scale, w=randn(10))


def test_group_must_divide_n() -> None:
    with pytest.raises(ValueError, match=r"reduction 'out' reduces groups of 4 columns, but its input has 22 columns"):
        coda.gemm(randn(M, K), randn(K, N), head_sums)


@pytest.mark.parametrize("ep, n, match", [
    (head_norm, 48, r"group_sum \(node %\d+\) reduces groups of 32 columns, but its input has 48 columns"),
    (half_head_max, 48, r"group_max \(node %\d+\) reduces groups of 16 columns, but its input has 24 columns"),
], ids=["full_width", "half_width"])
def test_value_group_must_divide_n(ep, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        coda.gemm(randn(M, K), randn(K, n), ep)


@pytest.mark.parametrize("ep", [head_norm, half_head_max], ids=["full_width", "half_width"])
def test_block_n_too_small_for_value_group(ep) -> None:
    """A subtile must hold whole groups (a half-width value's 16-column groups span 32 of N):
    never partial-group sums; the default config takes wide enough tiles."""
    a, b = randn(M, K), randn(K, 64)
    with pytest.raises(ValueError, match=r"Config.block_n=64 with subtile=4 is too small: grouped reductions need "
                                         r"block_n // subtile >= 32"):
        coda.runtime.run(ep.graph, a, b, {}, config=coda.Config(block_m=16, block_n=64, block_k=16, subtile=4))
    out = coda.gemm(a, b, ep)
    ref = ep.reference(a, b)
    for got, want in zip(*(x.values() if isinstance(x, dict) else [x] for x in (out, ref))):
        assert_close(got, want, a, b, ep.graph.name)


def test_out_tensor_for_multi_output_epilogue() -> None:
    with pytest.raises(TypeError, match=r"out= is a tensor but epilogue 'two_outputs' has several outputs \(y, s\); pass a dict"):
        coda.gemm(randn(M, K), randn(K, N), two_outputs, out=torch.empty(M, N, device=DEVICE))


def test_out_reduction_must_be_fp32() -> None:
    out = {"s": torch.empty(M, dtype=torch.bfloat16, device=DEVICE)}
    with pytest.raises(TypeError, match=r"out\['s'\] has dtype torch.bfloat16; expected one of torch.float32"):
        coda.gemm(randn(M, K), randn(K, N), two_outputs, out=out)


def test_out_reduction_wrong_shape() -> None:
    out = {"s": torch.empty(M, 1, device=DEVICE)}
    with pytest.raises(ValueError, match=r"out\['s'\] must have shape \[19\], got \[19, 1\]"):
        coda.gemm(randn(M, K), randn(K, N), two_outputs, out=out)


@pytest.mark.parametrize("fields, match", [
    (dict(block_m=16, block_n=24, block_k=16), r"Config.block_n must be a power of two, got 24"),
    (dict(block_m=48, block_n=16, block_k=16), r"Config.block_m must be a power of two, got 48"),
    (dict(block_m=16, block_n=16, block_k=8), r"block_k\n.*greater than or equal to 16"),
    (dict(block_m=16, block_n=16, block_k=16, num_wraps=4), r"num_wraps\n.*Extra inputs are not permitted"),
    (dict(block_m=16, block_n=64, block_k=16, subtile=3), r"Config.subtile must be a power of two, got 3"),
    (dict(block_m=16, block_n=64, block_k=16, subtile=8), r"Config.subtile=8 leaves 8 columns per epilogue subtile; at least 16"),
], ids=["block_n_24", "block_m_48", "block_k_8", "unknown_field", "subtile_3", "subtile_too_fine"])
def test_invalid_config(fields: dict, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        coda.Config(**fields)


def test_block_n_too_small_for_grouped_reduction() -> None:
    a, b = randn(M, K), randn(K, 64)
    with pytest.raises(ValueError, match=r"Config.block_n=16 with subtile=1 is too small: grouped reductions need "
                                         r"block_n // subtile >= 32"):
        coda.runtime.run(wide_head_sums.graph, a, b, {}, config=CFG)


# -- a rejected call writes nothing -----------------------------------------------------

@coda.epilogue
def add_into(acc, g: coda.Tile):
    return acc + g


def test_rejected_in_place_call_leaves_out_unchanged() -> None:
    g = randn(M, N)
    before = g.clone()
    with pytest.raises(ValueError, match=r"K differs"):
        coda.gemm(randn(M, K), randn(K + 1, N), add_into, out=g, g=g)
    assert torch.equal(g, before)


@pytest.mark.parametrize("name", ["vec_m_wrong_length", "missing_operand", "dtype_mismatch", "scalar_string", "operand_other_device"])
def test_rejected_call_leaves_out_unchanged(name: str) -> None:
    breaks, exc, _ = INPUTS[name]
    kw = affine_call()
    kw["out"] = torch.full((M, N), 7.0, device=DEVICE)
    breaks(kw)
    with pytest.raises(exc):
        gemm_call(kw)
    assert torch.equal(kw["out"], torch.full((M, N), 7.0, device=DEVICE))


def test_rejected_out_dict_leaves_valid_buffers_unchanged() -> None:
    """One bad buffer in out= rejects the whole call: the good one is not written either."""
    y = torch.full((M, N), 7.0, device=DEVICE)
    bad = torch.empty(M + 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"out\['s'\] must have shape \[19\], got \[20\]"):
        coda.gemm(randn(M, K), randn(K, N), two_outputs, out={"y": y, "s": bad})
    assert torch.equal(y, torch.full((M, N), 7.0, device=DEVICE))


def test_rejected_config_leaves_out_unchanged() -> None:
    out = torch.full((M, 2), 7.0, device=DEVICE)
    with pytest.raises(ValueError, match=r"too small"):
        coda.runtime.run(wide_head_sums.graph, randn(M, K), randn(K, 64), {}, out=out, config=CFG)
    assert torch.equal(out, torch.full((M, 2), 7.0, device=DEVICE))
