"""The CPU dispatch table's answers that the kernel tests ask (``kernels/cpu/dispatch.py``),
for this CPU now or for the facts given."""

from __future__ import annotations

from llmserve.kernels.cpu import dispatch


def quant_tiled_min_rows(facts=None) -> int | None:
    """From how many rows int4 products go to quant_gemm (None: never), on shapes every
    kernel takes."""
    found = dispatch.route(4, (dispatch.QUANT_GEMM,), facts)
    return None if found is None else found.first


def q8_rows_max(facts=None) -> int | None:
    """The most rows an int8 product goes to q8_rows for (None: any number)."""
    return dispatch.route(8, (dispatch.Q8_ROWS, dispatch.Q8_ROWS_INT8X), facts).last
