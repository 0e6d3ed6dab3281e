"""Value kinds, width factors and the operand annotations users write.

A value's *kind* says along which axes of the output tile it varies; its *width* says
how many columns it has relative to the GEMM's N (1/2, 1 or 2). Scalars and VecM
values have no column axis, so their width is always 1.
"""

from __future__ import annotations

from enum import Enum
from fractions import Fraction

WIDTHS = (Fraction(1, 2), Fraction(1), Fraction(2))


class Kind(str, Enum):
    SCALAR = "scalar"
    VEC_M = "vec_m"
    VEC_N = "vec_n"
    TILE = "tile"

    @property
    def has_cols(self) -> bool:
        return self in (Kind.VEC_N, Kind.TILE)

    @property
    def has_rows(self) -> bool:
        return self in (Kind.VEC_M, Kind.TILE)


def parse_width(width: object, what: str) -> Fraction:
    """Turn a user width (0.5, 1, 2, "1/2", Fraction) into one of WIDTHS or raise."""
    if isinstance(width, bool) or not isinstance(width, (int, float, str, Fraction)):
        raise TypeError(f"{what}: width must be a number (1/2, 1 or 2), got {width!r}")
    try:
        value = Fraction(width).limit_denominator(8)
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"{what}: width must be 1/2, 1 or 2, got {width!r}") from exc
    if value not in WIDTHS:
        raise ValueError(f"{what}: width must be 1/2, 1 or 2, got {width!r}")
    return value


def width_str(width: Fraction) -> str:
    return str(width)


def combine(a: tuple[Kind, Fraction], b: tuple[Kind, Fraction], op: str) -> tuple[Kind, Fraction]:
    """Broadcast two (kind, width) pairs; widths of column-carrying values must agree."""
    (ka, wa), (kb, wb) = a, b
    if ka.has_cols and kb.has_cols and wa != wb:
        raise ValueError(
            f"{op}: cannot combine a {ka.value} of width {wa} with a {kb.value} of width {wb}; "
            "column widths must match (use coda.pairs / coda.interleave to change width)"
        )
    rows = ka.has_rows or kb.has_rows
    cols = ka.has_cols or kb.has_cols
    width = wa if ka.has_cols else (wb if kb.has_cols else Fraction(1))
    if rows and cols:
        return Kind.TILE, width
    if cols:
        return Kind.VEC_N, width
    if rows:
        return Kind.VEC_M, Fraction(1)
    return Kind.SCALAR, Fraction(1)


class OperandType:
    """Base of the operand annotations. Usable as a class (`coda.VecM`) or an instance
    (`coda.VecN(width=0.5)`); both mean the same thing at width 1."""

    kind: Kind = Kind.SCALAR
    takes_width: bool = False

    def __init__(self, width: object = 1) -> None:
        if not self.takes_width and width != 1:
            raise TypeError(f"coda.{type(self).__name__} has no width (it has no column axis)")
        self.width = parse_width(width, f"coda.{type(self).__name__}")

    def __repr__(self) -> str:
        if self.takes_width and self.width != 1:
            return f"coda.{type(self).__name__}(width={self.width})"
        return f"coda.{type(self).__name__}"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.width == other.width  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.width))


class Scalar(OperandType):
    """A python number or a 0-d tensor."""

    kind = Kind.SCALAR


class VecM(OperandType):
    """A length-M vector: one value per output row (e.g. rstd, target token, position)."""

    kind = Kind.VEC_M


class VecN(OperandType):
    """A length-(width*N) vector: one value per output column (e.g. a norm weight)."""

    kind = Kind.VEC_N
    takes_width = True


class Tile(OperandType):
    """An [M, width*N] tensor aligned with the output tile (e.g. a residual)."""

    kind = Kind.TILE
    takes_width = True


def as_operand_type(annotation: object) -> OperandType | None:
    """An annotation as an OperandType instance, or None if it is not one."""
    if isinstance(annotation, OperandType):
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, OperandType) and annotation is not OperandType:
        return annotation()
    return None
