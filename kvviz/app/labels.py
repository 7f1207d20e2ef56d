"""What the app calls things: sources, scorers, allocations, cache formats and bit widths.

Display text only; the values they label are in kvviz.app.params.
"""

from __future__ import annotations

from kvviz.spec import FULL_BITS

SOURCE_LABELS = {"handbook": "Handbook example", "synthetic": "Synthetic pattern",
                 "real": "Real model", "file": "Trace file"}


class _Labels(dict):
    """Scorer labels; a plug-in (not listed) is labelled by its name and the start of its description."""

    def get(self, key, default=None):
        if key in self:
            return self[key]
        from kvviz.policies import POLICIES
        p = POLICIES.get(key)
        if p is None:
            return default if default is not None else str(key)
        return f"{key} (plug-in)" if self is SCORER_SHORT else f"{key} (plug-in: {p.description[:60]})"

    def __missing__(self, key):
        return self.get(key)


SCORER_SHORT = _Labels({"h2o": "H2O", "tova": "TOVA", "snapkv": "SnapKV", "streaming": "StreamingLLM",
                        "oracle": "oracle (bound)", "knorm": "K-norm", "random": "random",
                        "expected_attention": "Expected Attention", "keydiff": "KeyDiff", "chunkkv": "ChunkKV",
                        "quest": "Quest (reads)"})
SCORER_LABELS = _Labels({"h2o": "H2O (accumulated attention)", "tova": "TOVA (last query)",
                         "snapkv": "SnapKV (observation window vote)", "streaming": "StreamingLLM (position only)",
                         "oracle": "Oracle (this query's attention, per KV head; the bound)",
                         "knorm": "K-norm (smallest key norm)", "random": "Random (seeded baseline)",
                         "expected_attention": "Expected Attention (future queries' expected attention × ‖v‖)",
                         "keydiff": "KeyDiff (least similar to the mean key)",
                         "chunkkv": "ChunkKV (whole chunks of C tokens)",
                         "quest": "Quest (reads top pages per query; stores everything)"})
ALLOCATION_LABELS = {"uniform": "uniform (every head the same)",
                     "adakv": "AdaKV (per layer, across heads)", "pyramid": "PyramidKV (per layer, linear)"}

FORMAT_LABELS = {"int": "integer groups (bits above)", "e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2",
                 "nvfp4": "NVFP4 (E2M1, blocks of 16)", "mxfp4": "MXFP4 (E2M1, blocks of 32)"}


def bits_label(b: int) -> str:
    return "16 (off)" if b == FULL_BITS else str(b)


def scorer_help() -> str:
    from kvviz.policies import POLICIES
    from kvviz.policies.registry import load_entry_points
    load_entry_points()

    def line(name, p):
        extra = "; ".join(x for x in (p.paper, f"kvpress: {p.kvpress}" if p.kvpress else "") if x)
        return f"- **{SCORER_LABELS.get(name)}**: {p.description}." + (f" ({extra})" if extra else "")
    return "How heavy hitters are ranked:\n\n" + "\n".join(line(name, p) for name, p in POLICIES.items())
