"""Shared test helper: the small synthetic source that the engine, metric and solver tests build."""

from kvviz.sources.synthetic import SyntheticSpec


def small_synthetic(*, context: int, steps: int, layers: int, head_dim: int = 32, n_anchors: int = 4) -> SyntheticSpec:
    """A synthetic source of 4 query heads over 2 KV heads, with `n_anchors` heavy hitters and 2 shift
    tokens and 2 outlier key channels (fewer than the defaults): small and quick, with every feature."""
    return SyntheticSpec(
        context=context,
        steps=steps,
        layers=layers,
        q_heads=4,
        kv_heads=2,
        head_dim=head_dim,
        n_anchors=n_anchors,
        n_shift_tokens=2,
        outlier_channels=2,
    )
