"""Where a real model runs in the app: the devices this machine has and the weights' dtype.

`device_controls(container, prefix)` draws two select boxes (the Model lab's sidebar, the Real model
source) and returns (device, dtype). Only the devices torch sees here are offered (cpu, then cuda:N
and mps); the device is not put in the page's link (a link opened on another machine would name a
device it may not have), the dtype is where the settings table has it (the Model lab's `lab_dtype`).
`run_notice(exc)` is the one line an out-of-memory run or a device that went away shows instead of a
traceback; the server keeps serving.
"""

from __future__ import annotations

import streamlit as st

from kvviz.app.store import w_choice
from kvviz.links import PARAMS

DTYPES = PARAMS["lab_dtype"].choices
DTYPE_LABELS = {
    "float32": "float32 (exact, 4 bytes a weight)",
    "bfloat16": "bfloat16 (GPU default, half the memory)",
    "float16": "float16 (half the memory)",
}


@st.cache_resource(show_spinner=False)
def devices() -> tuple[str, ...]:
    """cpu, cuda:N, mps: what torch sees on this server (asked once per server process)."""
    from kvviz.decode.place import available_devices

    return tuple(available_devices())


def device_controls(container, prefix: str) -> tuple[str, str]:
    """(device, dtype) picked in `container`; keys `{prefix}_device` and `{prefix}_dtype`."""
    found = devices()
    device = container.selectbox(
        "Device",
        found,
        key=f"{prefix}_device",
        help="Where the model and its compressed cache run. Only the devices this server has are listed"
        + ("" if len(found) > 1 else " (no GPU here: cpu only)")
        + ".",
    )
    label, help_text = (
        "Weights dtype",
        "The model's weights, and the K/V cache with them, in this dtype. Attention over the cache "
        "runs in float32 either way; bfloat16 on a CPU is slower than float32.",
    )
    if f"{prefix}_dtype" in PARAMS:  # a setting of the page's link
        dtype = w_choice(container, f"{prefix}_dtype", label, DTYPES, format_func=DTYPE_LABELS.get, help=help_text)
    else:
        dtype = container.selectbox(label, DTYPES, key=f"{prefix}_dtype", format_func=DTYPE_LABELS.get, help=help_text)
    return str(device), str(dtype)


def run_notice(exc: BaseException) -> str | None:
    """One line for an out-of-memory run or a missing device (shown with st.error), else None."""
    from kvviz.decode.place import device_error

    line = device_error(exc)
    if line is None:
        return None
    return line.replace("--prompt-tokens / --continuation-tokens (or the lengths)", "the token counts").replace(
        "--dtype bfloat16 or float16", "the bfloat16 or float16 dtype"
    )
