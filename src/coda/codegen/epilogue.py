"""IR nodes -> Triton statements for the epilogue body, operand loads, stores and partials.

Inside a (sub)tile, shapes are: scalar -> scalar, vec_m -> [BLOCK_M, 1], vec_n -> [1, C],
tile -> [BLOCK_M, C], where C is the value's column count (EPI_N, the subtile's columns,
times its width). Code that depends on columns is emitted once and repeated per subtile
by codegen; Scalar and VecM loads (`row_loads`) run once per tile.
Arithmetic is fp32; integer operands and indices stay integers until arithmetic or a
comparison with a float needs otherwise, so integer comparisons are exact.

One emitter serves both backends: a `Dialect` names the language module (`tl` or `gl`),
how index ranges are laid out (Gluon ranges carry explicit layouts), and how values made by
reshapes return to the epilogue's layout. Primitive texts come from `coda.ir.primitives`.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ..ir.graph import Graph
from ..ir.nodes import (
    BinaryNode, ConstNode, GroupNode, IndexNode, InputNode, InterleaveNode, PairNode, ReduceOutput,
    StoreOutput, UnaryNode, WhereNode,
)
from ..ir.primitives import GROUP_REDUCTIONS, PRIMITIVES, REDUCTIONS
from ..ir.types import Kind
from .dialect import Dialect, dialect_of
from .spec import FLOAT_DTYPES, OperandForm, Specialization, width_suffix

_DTYPE = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def cols(width: Fraction) -> str:
    """Column count of a tile value of this width, as a constexpr expression."""
    return {Fraction(1, 2): "(EPI_N // 2)", Fraction(1): "EPI_N", Fraction(2): "(EPI_N * 2)"}[width]


def col_start(width: Fraction) -> str:
    return {Fraction(1, 2): "(off_n // 2)", Fraction(1): "off_n", Fraction(2): "(off_n * 2)"}[width]


def n_total(width: Fraction) -> str:
    return {Fraction(1, 2): "(N // 2)", Fraction(1): "N", Fraction(2): "(N * 2)"}[width]


def _col_vars(width: Fraction) -> tuple[str, str]:
    s = width_suffix(width)
    return f"cols_{s}", f"mask_{s}"


def _literal(value: float, ns: str) -> str:
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    if value == 0.0 and math.copysign(1.0, value) < 0:
        # Triton turns a -0.0 constant into its null value (+0.0); build it from its bits.
        return f"{ns}.full((), -2147483648, {ns}.int32).to({ns}.float32, bitcast=True)"
    return repr(float(value))


class EpilogueEmitter:
    """Emits the epilogue's code blocks; `widths` collects the column widths it used."""

    def __init__(self, graph: Graph, spec: Specialization) -> None:
        self.graph = graph
        self.spec = spec
        self.d: Dialect = dialect_of(spec.backend)
        self.ns = self.d.ns
        self.forms: dict[str, OperandForm] = {f.name: f for f in spec.operands}
        self.kinds = {s.name: s for s in graph.operands}
        self.widths: set[Fraction] = set()
        self.row_widths: set[Fraction] = set()  # Gluon: widths whose tiles index rows (rows_<w>, mask_m_<w>)
        self.var: dict[int, str] = {}
        self.dtype: dict[int, str] = {}  # "f32" | "int" | "bool"
        self.row_loads: list[str] = []  # Scalar and VecM operands: once per tile
        self.loads: list[str] = []  # the rest: once per subtile
        self.body: list[str] = []
        self._splits: dict[int, tuple[str, str]] = {}
        self._widened: dict[tuple[int, Fraction], str] = {}

    # -- helpers ---------------------------------------------------------------------
    def f32(self, node_id: int, width: Fraction | None = None) -> str:
        """The value as fp32, as an argument of an op whose result has `width` columns."""
        v = self.arg(node_id, width)
        return v if self.dtype[node_id] == "f32" else f"{v}.to({self.ns}.float32)"

    def arg(self, node_id: int, width: Fraction | None) -> str:
        """The value as an argument of an op whose result has columns of `width` (None: no
        columns). In Gluon a row vector ([BLOCK_M, 1], in the width-1 layout) meeting columns
        of another width takes that width's layout first: free, the rows are the same."""
        v = self.var[node_id]
        node = self.graph.node(node_id)
        if width is None or width == 1 or not self.d.layouts or node.kind != Kind.VEC_M:
            return v
        key = (node_id, width)
        if key not in self._widened:
            name = f"v{node_id}_{width_suffix(width)}"
            self.body.append(f"{name} = {self.d.relayout(v, width)}")
            self._widened[key] = name
        return self._widened[key]

    def _result_width(self, node_id: int) -> Fraction | None:
        node = self.graph.node(node_id)
        return node.frac_width if node.kind.has_cols else None

    def _set(self, node_id: int, expr: str, dtype: str) -> None:
        name = f"v{node_id}"
        self.body.append(f"{name} = {expr}")
        self.var[node_id] = name
        self.dtype[node_id] = dtype

    def _col_names(self, width: Fraction) -> tuple[str, str]:
        """The column-offset and mask variables of a width; declares that the tile needs them."""
        self.widths.add(width)
        return _col_vars(width)

    def _row_names(self, width: Fraction) -> tuple[str, str]:
        """The row-offset and row-mask variables indexing tiles of a width (Gluon lays them out
        per width; Triton has one of each)."""
        if not self.d.layouts or width == 1:
            return "rows", "mask_m"
        self.row_widths.add(width)
        s = width_suffix(width)
        return f"rows_{s}", f"mask_m_{s}"

    # -- operands --------------------------------------------------------------------
    def _load_operand(self, node: InputNode) -> tuple[str, str]:
        spec, form = self.kinds[node.name], self.forms[node.name]
        base = f"in_{node.name}"
        if spec.kind == Kind.SCALAR and form.dtype is None:
            # A Python float reaches the GPU kernel as fp32 (1e39 becomes inf); the interpreter
            # passes it as a Python float, which Triton would type fp64 when out of fp32 range.
            if self.spec.interpret:
                return f"tl.cast({base}_val, tl.float32)", "f32"
            return f"{base}_val", "f32"
        ns = self.ns
        if spec.kind == Kind.SCALAR:
            expr = f"{ns}.load({base}_ptr)"
        elif spec.kind == Kind.VEC_M:
            expr = f"{ns}.load({base}_ptr + rows * {base}_s0, mask=mask_m, other=0)[:, None]"
        elif spec.kind == Kind.VEC_N:
            c, mk = self._col_names(spec.frac_width)
            expr = f"{ns}.load({base}_ptr + {c} * {base}_s0, mask={mk}, other=0)[None, :]"
        elif node.name in self.spec.tma_tiles:  # the descriptor zero-fills the ragged edges
            expr = self.d.tma_tile_load(node.name, base, col_start(spec.frac_width), spec.frac_width)
        else:
            c, mk = self._col_names(spec.frac_width)
            r, rk = self._row_names(spec.frac_width)
            expr = (
                f"{ns}.load({base}_ptr + {r}[:, None] * {base}_s0 + {c}[None, :] * {base}_s1, "
                f"mask={rk}[:, None] & {mk}[None, :], other=0)"
            )
        if form.dtype in FLOAT_DTYPES:
            return f"{expr}.to({ns}.float32)", "f32"
        return expr, "bool" if form.dtype == "bool" else "int"

    # -- values ----------------------------------------------------------------------
    def emit_values(self) -> None:
        for node in self.graph.nodes:
            nid = node.id
            if isinstance(node, InputNode):
                if node.name == "acc":
                    self.var[nid], self.dtype[nid] = "epi_acc", "f32"
                    continue
                expr, dtype = self._load_operand(node)
                name = f"v{nid}"
                per_row = self.kinds[node.name].kind in (Kind.SCALAR, Kind.VEC_M)
                (self.row_loads if per_row else self.loads).append(f"{name} = {expr}")
                self.var[nid], self.dtype[nid] = name, dtype
            elif isinstance(node, ConstNode):
                self.var[nid], self.dtype[nid] = _literal(node.value, self.ns), "f32"
            elif isinstance(node, IndexNode):
                if node.axis == "m":
                    self._set(nid, "offs_m[:, None]", "int")
                else:
                    c, _ = self._col_names(node.frac_width)
                    self._set(nid, f"{c}[None, :]", "int")
            elif isinstance(node, UnaryNode):
                if node.fn == "round_bf16" and self.spec.interpret:  # the interpreter truncates
                    self._set(nid, f"_bf16_rne({self.f32(node.x)}).to(tl.float32)", "f32")
                else:
                    self._set(nid, PRIMITIVES[node.fn].emit(self.d.backend, self.f32(node.x)), "f32")
            elif isinstance(node, BinaryNode):
                prim = PRIMITIVES[node.fn]
                w = self._result_width(nid)
                if prim.result == "bool":  # raw operands: integer comparisons stay exact
                    self._set(nid, prim.emit(self.d.backend, self.arg(node.x, w), self.arg(node.y, w)), "bool")
                else:
                    self._set(nid, prim.emit(self.d.backend, self.f32(node.x, w), self.f32(node.y, w)), "f32")
            elif isinstance(node, WhereNode):
                w = self._result_width(nid)
                cond = self.arg(node.cond, w)
                c = cond if self.dtype[node.cond] == "bool" else f"({cond} != 0)"
                self._set(nid, f"{self.ns}.where({c}, {self.f32(node.x, w)}, {self.f32(node.y, w)})", "f32")
            elif isinstance(node, PairNode):
                even, odd = self._split(node.x)
                self.var[nid], self.dtype[nid] = (even, odd)[node.half], self.dtype[node.x]
            elif isinstance(node, InterleaveNode):
                half = node.frac_width / 2
                self._set(nid, self.d.interleave(self.f32(node.x, half), self.f32(node.y, half), node.kind,
                                                 cols(node.frac_width), node.frac_width), "f32")
            elif isinstance(node, GroupNode):
                # whole groups per subtile: the runtime's configs hold them (Graph.column_groups)
                expr = GROUP_REDUCTIONS[node.op].emit(self.d.backend, self.f32(node.x), node.group)
                self._set(nid, self.d.relayout(expr, node.frac_width), "f32")

    def _split(self, x: int) -> tuple[str, str]:
        if x not in self._splits:
            kind, width = self.graph.node(x).kind, self.graph.node(x).frac_width
            value, rows = self.d.split_operand(self.var[x], kind, cols(width), width)
            even, odd = f"v{x}_even", f"v{x}_odd"
            ns = self.ns
            self.body.append(f"{even}, {odd} = {ns}.split({ns}.reshape({value}, ({rows}, {cols(width)} // 2, 2)))")
            for half in (even, odd):
                relaid = self.d.relayout(half, width / 2)
                if relaid != half:
                    self.body.append(f"{half} = {relaid}")
            self._splits[x] = (even, odd)
        return self._splits[x]

    # -- sinks -----------------------------------------------------------------------
    def emit_stores(self) -> list[str]:
        lines, copies = [], []
        stores = dict(self.spec.store_dtypes)
        for out in self.graph.outputs:
            if not isinstance(out, StoreOutput):
                continue
            width = self.graph.node(out.x).frac_width
            value = self.f32(out.x)
            dtype = stores[out.name]
            if dtype == "bfloat16" and self.spec.interpret:
                value = f"_bf16_rne({value})"
            elif dtype != "float32":
                value = f"({value}).to({self.ns}.{_DTYPE[dtype]})"
            base = f"out_{out.name}"
            if out.name in self.spec.tma_stores:
                # The descriptor clips the ragged edges; no mask needed.
                write, copy = self.d.tma_store(out.name, base, col_start(width), value)
                lines.append(write)
                copies += [copy] if copy else []
                continue
            c, mk = self._col_names(width)
            r, rk = self._row_names(width)
            lines.append(
                f"{self.ns}.store({base}_ptr + {r}[:, None] * {base}_s0 + {c}[None, :] * {base}_s1, {value}, "
                f"mask={rk}[:, None] & {mk}[None, :])"
            )
        return self.d.order_stores(lines, copies)

    def emit_reductions(self) -> list[str]:
        lines: list[str] = []
        for out in self.graph.outputs:
            if isinstance(out, ReduceOutput):
                lines += self._reduction(out)
        return lines

    def _reduction(self, out: ReduceOutput) -> list[str]:
        width = self.graph.node(out.x).frac_width
        c, mk = self._col_names(width)
        x = self.f32(out.x)
        ns = self.ns
        base, p = f"out_{out.name}", f"red_{out.name}"
        r = f"{p}_r"  # its temporaries are {p}_nan, {p}_max, {p}_cols: one suffix each (spec.py)
        if out.axis == "m":
            _, rmask = self._row_names(width)
            return [
                f"{r} = {ns}.sum({ns}.where({rmask}[:, None], {x}, 0.0), axis=0)",
                f"{ns}.store({base}_ptr + pid_m.to({ns}.int64) * {n_total(width)} + {c}, {r}, mask={mk})",
            ]
        identity = REDUCTIONS[out.op].identity
        lines = [f"{r} = {ns}.where({mk}[None, :], {x}, {identity})"]
        axis = 1
        if out.group is not None:
            lines.append(f"{r} = {ns}.reshape({r}, (BLOCK_M, {cols(width)} // {out.group}, {out.group}))")
            axis = 2
        if out.op == "sum":
            lines.append(f"{r} = {ns}.sum({r}, axis={axis})")
        elif out.op == "max":  # tl.max drops NaN; torch.amax (the oracle) propagates it
            lines += [
                f"{p}_nan = {ns}.sum(({r} != {r}).to({ns}.int32), axis={axis}) > 0",
                f'{r} = {ns}.where({p}_nan, float("nan"), {ns}.max({r}, axis={axis}))',
            ]
        else:
            lines += [
                f"{p}_max = {ns}.max({r}, axis={axis})",
                # shift by 0 when the max is +-inf (as torch.logsumexp): inf - inf would be NaN
                f'{p}_max = {ns}.where({ns}.abs({p}_max) == float("inf"), 0.0, {p}_max)',
                f"{r} = {p}_max + {ns}.log({ns}.sum({ns}.exp({r} - {ns}.expand_dims({p}_max, {axis})), axis={axis}))",
            ]
        if out.group is not None:  # back from the reshape's layout to the epilogue's
            relaid = self.d.relayout(r, Fraction(1), trivial=False)
            if relaid != r:
                lines.append(f"{r} = {relaid}")
        if out.group is None:
            rows, rmask = self._row_names(width)
            lines.append(f"{ns}.store({base}_ptr + {rows} * (num_pid_n * {self.spec.subtile}) + part_n, {r}, mask={rmask})")
        else:
            g = out.group
            lines += [
                f"{p}_cols = {col_start(width)} // {g} + {self.d.arange(f'{cols(width)} // {g}', 'n')}",
                f"{ns}.store({base}_ptr + rows[:, None] * {base}_s0 + {p}_cols[None, :] * {base}_s1, {r}, "
                f"mask=mask_m[:, None] & ({p}_cols[None, :] < {n_total(width)} // {g}))",
            ]
        return lines

    def emit_columns(self) -> list[str]:
        lines = []
        for width in sorted(self.widths):
            c, mk = _col_vars(width)
            if width == 1:
                lines += [f"{c} = offs_n", f"{mk} = mask_n"]
            else:
                lines += [
                    f"{c} = {col_start(width)} + {self.d.arange(cols(width), 'n', width)}",
                    f"{mk} = {c} < {n_total(width)}",
                ]
        return lines

    def emit_rows(self) -> list[str]:
        """Per tile: the row offsets and masks of the widths whose tiles index rows (Gluon)."""
        lines = []
        for width in sorted(self.row_widths):
            r, rk = self._row_names(width)
            lines += [f"{r} = {self.d.row_vector('rows', width)}", f"{rk} = {self.d.row_vector('mask_m', width)}"]
        return lines
