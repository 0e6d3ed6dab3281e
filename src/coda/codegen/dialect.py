"""What differs between the two backends' epilogue text, and nothing else.

The emitter writes one epilogue for either dialect; a `Dialect` answers the few questions
whose answers differ: the language module's name, how an index range is laid out, how a
value made by a reshape (pairs, interleave, grouped reductions) returns to the epilogue's
layout, and how Tile operands and tile outputs move through TMA. The names these texts use
(`EPI`, `COLS`, `ROWS` and their `_H` / `_2` variants, `e_slot`, `stage_<out>`, `CID`) are part of the emitter-template
contract written down in `coda.templates.CONTRACT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


_SUFFIX = {Fraction(1, 2): "_H", Fraction(1): "", Fraction(2): "_2"}


def layout_suffix(width: Fraction) -> str:
    """Gluon: the suffix of the layout names of values of this column width (EPI_H, EPI, EPI_2)."""
    return _SUFFIX[width]


def _all_rows(expr: str, columns: str, width: Fraction) -> str:
    """Gluon: a column vector ([1, columns]) broadcast to every row of a tile of this width."""
    return f"gl.broadcast({expr}, gl.zeros((BLOCK_M, {columns}), gl.int8, EPI{_SUFFIX[width]}))[0]"


@dataclass(frozen=True)
class Dialect:
    backend: str
    ns: str  # the language module as the generated source names it

    @property
    def layouts(self) -> bool:
        """Whether values carry explicit layouts (Gluon), one per column width."""
        return self.ns == "gl"

    def arange(self, count: str, axis: str, width: Fraction = Fraction(1)) -> str:
        """`0 .. count` along the output's rows ("m") or columns ("n") of a value of this width."""
        if not self.layouts:
            return f"tl.arange(0, {count})"
        return f"gl.arange(0, {count}, layout={'ROWS' if axis == 'm' else 'COLS'}{_SUFFIX[width]})"

    def relayout(self, expr: str, width: Fraction, trivial: bool = True) -> str:
        """A value produced by reshape/split/join (or a row vector meeting columns of another
        width), in the layout of its width. Pairs, widths and group_sum / group_max values
        (reshaped to [rows, groups, g], reduced, broadcast back) move no data in Gluon: the
        conversion is asserted trivial at compile time; `trivial=False` only for grouped
        reduction outputs, whose [rows, groups] results take one small shuffle."""
        if not self.layouts:
            return expr
        check = ", assert_trivial=True" if trivial else ""
        return f"gl.convert_layout({expr}, EPI{_SUFFIX[width]}{check})"

    def row_vector(self, expr: str, width: Fraction) -> str:
        """A [BLOCK_M] row vector (offsets, masks) in the row layout of values of this width."""
        if not self.layouts or width == 1:
            return expr
        return f"gl.convert_layout({expr}, ROWS{_SUFFIX[width]}, assert_trivial=True)"

    def split_operand(self, expr: str, kind: object, columns: str, width: Fraction) -> tuple[str, str]:
        """The value a column-pair split reshapes, and its row count. Gluon splits a column
        vector ([1, cols]) as a whole tile: triton 3.6's Gluon infers a split's layout of a
        one-row tensor unlike its verifier (a compile error), and a broadcast row costs no
        data movement; the halves then hold every row, which broadcasting treats alike."""
        if kind.value == "tile":
            return expr, "BLOCK_M"
        if not self.layouts:
            return expr, "1"
        return _all_rows(expr, columns, width), "BLOCK_M"

    def interleave(self, x: str, y: str, kind: object, columns: str, width: Fraction) -> str:
        """Columns (x_0, y_0, x_1, y_1, ...) of the given (result) width. Triton's own interleave;
        in Gluon a join and reshape, in the layout of that width again (column vectors as whole
        tiles, as in `split_operand`)."""
        if not self.layouts:
            return f"tl.interleave({x}, {y})"
        if kind.value != "tile":
            x, y = (_all_rows(v, f"{columns} // 2", width / 2) for v in (x, y))
        return self.relayout(f"gl.reshape(gl.join({x}, {y}), (BLOCK_M, {columns}))", width)

    def tma_tile_load(self, name: str, base: str, col: str, width: Fraction) -> str:
        """One (sub)tile of a TMA-read Tile operand."""
        if not self.layouts:
            return f"{base}_ptr.load([off_m, {col}])"
        # The epilogue loader warp prefetched it into this subtile's slot of the ring.
        return f"ering_{name}.index(e_slot).load(EPI{_SUFFIX[width]})"

    def tma_store(self, name: str, base: str, col: str, value: str) -> tuple[str, str | None]:
        """A tile output written through its TMA descriptor (which clips ragged edges): the
        line that writes it and, for Gluon, the asynchronous copy to issue after the fence."""
        if not self.layouts:
            return f"{base}_ptr.store([off_m, {col}], {value})", None
        stage = f"stage_{name}.index(s_buf)"  # this consumer's staging buffer for this subtile
        return f"{stage}.store({value})", f"tma.async_copy_shared_to_global({base}_ptr, [off_m, {col}], {stage})"

    def order_stores(self, writes: list[str], copies: list[str]) -> list[str]:
        """Gluon: before the first staging write, wait until the copies that last read these
        buffers are done (those of STAGE_BUFS subtiles ago: the later ones may still run), then
        one fence, then every copy (they run while the epilogue goes on)."""
        if not copies:
            return writes
        return [f"tma.store_wait((STAGE_BUFS - 1) * {len(copies)})"] + writes + ["fence_async_shared()"] + copies


TRITON = Dialect("triton", "tl")
GLUON_HOPPER = Dialect("gluon-hopper", "gl")
_DIALECTS = {d.backend: d for d in (TRITON, GLUON_HOPPER)}


def dialect_of(backend: str) -> Dialect:
    return _DIALECTS[backend]
