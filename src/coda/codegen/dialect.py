"""What differs between the two backends' epilogue text, and nothing else.

The emitter writes one epilogue for either dialect; a `Dialect` answers the few questions
whose answers differ: the language module's name, how an index range is laid out, how a
value made by a reshape (pairs, interleave, grouped reductions) returns to the epilogue's
layout, and how Tile operands and tile outputs move through TMA. The names these texts use
(`EPI`, `COLS`, `ROWS`, `e_slot`, `stage_<out>`, `CID`) are part of the emitter-template
contract written down in `coda.templates.CONTRACT`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dialect:
    backend: str
    ns: str  # the language module as the generated source names it

    def arange(self, count: str, axis: str) -> str:
        """`0 .. count` along the output's rows ("m") or columns ("n")."""
        if self.ns == "tl":
            return f"tl.arange(0, {count})"
        return f"gl.arange(0, {count}, layout={'ROWS' if axis == 'm' else 'COLS'})"

    def relayout(self, expr: str) -> str:
        """A value produced by reshape/split/join, in the epilogue's layout again."""
        return expr if self.ns == "tl" else f"gl.convert_layout({expr}, EPI)"

    def interleave(self, x: str, y: str, kind: object, columns: str) -> str:
        """Columns (x_0, y_0, x_1, y_1, ...). Triton's own interleave; in Gluon a join and reshape,
        back in the epilogue's layout."""
        if self.ns == "tl":
            return f"tl.interleave({x}, {y})"
        rows = "BLOCK_M" if kind.value == "tile" else "1"
        return self.relayout(f"gl.reshape(gl.join({x}, {y}), ({rows}, {columns}))")

    def tma_tile_load(self, name: str, base: str, col: str) -> str:
        """One (sub)tile of a TMA-read Tile operand."""
        if self.ns == "tl":
            return f"{base}_ptr.load([off_m, {col}])"
        # The epilogue loader warp prefetched it into this subtile's slot of the ring.
        return f"ering_{name}.index(e_slot).load(EPI)"

    def tma_store(self, name: str, base: str, col: str, value: str) -> tuple[str, str | None]:
        """A tile output written through its TMA descriptor (which clips ragged edges): the
        line that writes it and, for Gluon, the asynchronous copy to issue after the fence."""
        if self.ns == "tl":
            return f"{base}_ptr.store([off_m, {col}], {value})", None
        stage = f"stage_{name}.index(CID)"  # this consumer's staging buffer
        return f"{stage}.store({value})", f"tma.async_copy_shared_to_global({base}_ptr, [off_m, {col}], {stage})"

    def order_stores(self, writes: list[str], copies: list[str]) -> list[str]:
        """Gluon: wait for this consumer's previous copies before the first staging write, then
        one fence, then every copy (they run while the epilogue goes on)."""
        if not copies:
            return writes
        return ["tma.store_wait(0)"] + writes + ["fence_async_shared()"] + copies


TRITON = Dialect("triton", "tl")
GLUON_HOPPER = Dialect("gluon-hopper", "gl")
_DIALECTS = {d.backend: d for d in (TRITON, GLUON_HOPPER)}


def dialect_of(backend: str) -> Dialect:
    return _DIALECTS[backend]
