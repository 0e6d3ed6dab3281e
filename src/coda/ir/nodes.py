"""The IR's node models. Values are nodes; outputs (stores, reductions) are sinks.

Every node carries its kind and width so that a graph can be checked and printed
without re-deriving them; `coda.ir.graph` re-derives them to validate.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .primitives import ARITH_FNS, BINARY_FNS, COMPARE_FNS, GROUP_OPS, REDUCE_M_OPS, REDUCE_N_OPS, UNARY_FNS  # noqa: F401
from .types import Kind

WidthStr = Literal["1/2", "1", "2"]

UnaryFn = Literal[UNARY_FNS]  # type: ignore[valid-type]
BinaryFn = Literal[BINARY_FNS]  # type: ignore[valid-type]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Value(_Model):
    id: int = Field(ge=0)
    kind: Kind
    width: WidthStr = "1"

    @property
    def frac_width(self) -> Fraction:
        return Fraction(self.width)

    @property
    def args(self) -> tuple[int, ...]:
        return ()


class InputNode(_Value):
    """The accumulator (`name == "acc"`) or a declared operand."""

    family: Literal["input"] = "input"
    name: str


class ConstNode(_Value):
    family: Literal["const"] = "const"
    value: float


class IndexNode(_Value):
    """Global row (axis m) or column (axis n, at the node's width) indices, int32."""

    family: Literal["index"] = "index"
    axis: Literal["m", "n"]


class UnaryNode(_Value):
    family: Literal["unary"] = "unary"
    fn: UnaryFn
    x: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.x,)


class BinaryNode(_Value):
    family: Literal["binary"] = "binary"
    fn: BinaryFn
    x: int
    y: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.x, self.y)


class WhereNode(_Value):
    family: Literal["where"] = "where"
    cond: int
    x: int
    y: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.cond, self.x, self.y)


class PairNode(_Value):
    """Column `2i + half` of x for each i: half 0 is the even columns, 1 the odd."""

    family: Literal["pair"] = "pair"
    x: int
    half: Literal[0, 1]

    @property
    def args(self) -> tuple[int, ...]:
        return (self.x,)


class InterleaveNode(_Value):
    """Columns (x_0, y_0, x_1, y_1, ...): the inverse of a pair split."""

    family: Literal["interleave"] = "interleave"
    x: int
    y: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.x, self.y)


class GroupNode(_Value):
    """Per row, `op` over each group of `group` consecutive columns of x, in every column of the
    group (coda.group_sum / group_max): a per-head statistic as a value, not an output."""

    family: Literal["group"] = "group"
    op: Literal[GROUP_OPS]  # type: ignore[valid-type]
    x: int
    group: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.x,)


Node = Annotated[
    Union[InputNode, ConstNode, IndexNode, UnaryNode, BinaryNode, WhereNode, PairNode, InterleaveNode, GroupNode],
    Field(discriminator="family"),
]


class StoreOutput(_Model):
    """A tile written to an [M, width*N] tensor (dtype of `a` unless `out=` says otherwise)."""

    family: Literal["store"] = "store"
    name: str
    x: int


class ReduceOutput(_Model):
    """A reduction sink, fp32: over columns (axis n) per row, or over rows (axis m) per column."""

    family: Literal["reduce"] = "reduce"
    name: str
    x: int
    axis: Literal["n", "m"]
    op: Literal[REDUCE_N_OPS]  # type: ignore[valid-type]  (reduce_m ops are a subset)
    group: Optional[int] = None


Output = Annotated[Union[StoreOutput, ReduceOutput], Field(discriminator="family")]


class OperandSpec(_Model):
    name: str
    kind: Kind
    width: WidthStr = "1"

    @property
    def frac_width(self) -> Fraction:
        return Fraction(self.width)
