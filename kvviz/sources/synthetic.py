"""A tunable synthetic attention pattern with real q, k, v vectors.

Each head's channels are split into four orthogonal parts, so every ingredient of the
logits q . k / sqrt(d) can be dialled on its own:

    rotary   8 channel pairs rotated by position (RoPE)       -> locality: recent tokens
    sink     one direction carried by the first token's key   -> an attention sink
    anchors  one direction per heavy-hitter token              -> anchor tokens
    random   the remaining channels, Gaussian                  -> background; its spread
                                                                  sets how sparse it is
Queries carry each direction with a weight: the logit a query gives the sink is
`sink_strength`, an anchor `anchor_strength`, the newest token `local_strength`.
A "topic shift" adds late anchors that no context query looks at, but which the later
queries need after the shift: the case where history-based eviction fails.
Key outlier channels (a few channels of large magnitude that vary a little from token to
token, as real keys have) barely change attention but wreck per-token key quantization —
the reason KIVI quantizes keys per channel.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from kvviz.limits import Part, Work, checkpoint
from kvviz.spec import SpecError
from kvviz.trace import Trace

MAX_CONTEXT = 32768
MAX_STEPS = 512
N_ROPE_PAIRS = 8
# one head's float64 temporaries in make_synthetic (key, value, query, draws)
SCRATCH_ARRAYS = 6


@dataclass(frozen=True)
class SyntheticSpec:
    context: int = 512  # context (prompt) tokens; the compression point
    steps: int = 32  # later queries (decode steps) that read the compressed cache
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    seed: int = 0
    # Defaults: "realistic", concentrated like a real model's attention (SmolLM2-135M on a
    # 206-token prompt: the top 10% of keys hold 84% of the mass, the first token 36%);
    # here the top 10% hold ~87% and the first token ~33%. PRESETS["diffuse"] is the hard case.
    sink_strength: float = 11.0  # logit boost on the first token
    local_strength: float = 5.0  # logit boost on the newest token, fading with distance
    local_width: float = 8.0  # tokens over which locality fades
    n_anchors: int = 6  # heavy-hitter tokens every query attends to
    anchor_strength: float = 4.0
    sparsity: float = 2.0  # std of the background logits (higher = spikier)
    topic_shift: float = 0.0  # logit boost later queries give late anchors (0 = off)
    shift_at: float = 0.5  # fraction of the later steps after which the shift happens
    n_shift_tokens: int = 4
    outlier_channels: int = 4  # key channels with large magnitude
    outlier_scale: float = 12.0

    def __post_init__(self) -> None:
        check_synthetic(self)

    def with_(self, **changes) -> "SyntheticSpec":
        return replace(self, **changes)

    def work(self) -> Work:
        """What `make_synthetic` holds: q, k, v in float32 and one head's float64 scratch."""
        positions, dims = (self.context + self.steps, "positions"), (self.head_dim, "dims")
        return Work(
            "the synthetic pattern",
            (
                Part(
                    "queries",
                    ((self.layers, "layers"), (self.q_heads, "query heads"), positions, dims),
                ),
                Part(
                    "keys and values",
                    (
                        (2, ""),
                        (self.layers, "layers"),
                        (self.kv_heads, "KV heads"),
                        positions,
                        dims,
                    ),
                ),
                Part("scratch", ((SCRATCH_ARRAYS, ""), positions, dims), item_bytes=8),
            ),
            lower="the context, the later steps, the layers, the heads or the head dim",
        )

    def as_dict(self) -> dict:
        return asdict(self)


def check_synthetic(s: SyntheticSpec) -> None:
    if not 8 <= s.context <= MAX_CONTEXT:
        raise SpecError(f"context must be 8-{MAX_CONTEXT} tokens, got {s.context}")
    if not 0 <= s.steps <= MAX_STEPS:
        raise SpecError(f"later steps must be 0-{MAX_STEPS}, got {s.steps}")
    if s.layers < 1 or s.q_heads < 1 or s.kv_heads < 1 or s.q_heads % s.kv_heads:
        raise SpecError("need at least one layer, and query heads a multiple of KV heads")
    reserved = 2 * N_ROPE_PAIRS + 1 + s.n_anchors + s.n_shift_tokens + s.outlier_channels + 4
    if s.head_dim < reserved:
        raise SpecError(
            f"head dim {s.head_dim} is too small for these knobs; needs at least {reserved}"
        )
    if s.n_anchors + s.n_shift_tokens > s.context // 2:
        raise SpecError("too many anchor / topic-shift tokens for this context length")
    if s.local_width <= 0 or not 0 <= s.shift_at <= 1:
        raise SpecError("locality width must be positive and the shift point between 0 and 1")
    values = (
        s.sink_strength,
        s.local_strength,
        s.anchor_strength,
        s.sparsity,
        s.topic_shift,
        s.outlier_scale,
    )
    if not all(np.isfinite(values)) or min(values) < 0:
        raise SpecError("strengths, sparsity and scales must be finite and non-negative")
    s.work().check()  # before anything is allocated: the knobs' product, not each knob alone


PRESETS = {
    "realistic": SyntheticSpec(),  # concentrated like a real model's attention (the defaults)
    # the hard case:
    "diffuse": SyntheticSpec(sink_strength=8.0, anchor_strength=5.0, sparsity=1.5),
    # a weak sink and a flat background; H2O needs ~400 of 513 tokens for 95% of the mass
    "topic shift": SyntheticSpec(steps=48, topic_shift=12.0),  # late anchors no context query saw
}


def _rope_frequencies(width: float) -> tuple[np.ndarray, np.ndarray]:
    """Frequencies and weights whose cosine sum is 1 at distance 0 and fades over ~width tokens.

    Geometrically spaced frequencies (as in RoPE) avoid a periodic echo of the peak.
    """
    theta = np.geomspace(np.pi / 2, np.pi / (8 * width), N_ROPE_PAIRS)
    weight = np.full(N_ROPE_PAIRS, 1.0 / N_ROPE_PAIRS)
    return theta, weight


def _rotate(x: np.ndarray, positions: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Apply rotary position encoding to channel pairs: x (..., n, pairs, 2)."""
    angle = positions[:, None] * theta[None, :]  # (n, pairs)
    cos, sin = np.cos(angle), np.sin(angle)
    x0, x1 = x[..., 0], x[..., 1]
    return np.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def make_synthetic(spec: SyntheticSpec = SyntheticSpec()) -> Trace:
    """Generate a trace: context + later steps, every position has a query.

    Checks the work budget first (the limit may have changed since the spec was made) and
    calls `kvviz.limits.checkpoint()` after every head, so a cancelled request stops within one.
    """
    spec.work().check()
    rng = np.random.default_rng(spec.seed)
    L, Hq, Hkv, D = spec.layers, spec.q_heads, spec.kv_heads, spec.head_dim
    P = spec.context + spec.steps
    pos = np.arange(P)
    sqrt_d = np.sqrt(D)

    # Channel layout: [rotary pairs | sink | anchors | shift anchors | outliers | random]
    n_rot = 2 * N_ROPE_PAIRS
    c_sink = n_rot
    c_anchor = c_sink + 1
    c_shift = c_anchor + spec.n_anchors
    c_out = c_shift + spec.n_shift_tokens
    c_rand = c_out + spec.outlier_channels
    n_rand = D - c_rand
    theta, rope_w = _rope_frequencies(spec.local_width)

    # Token roles, shared by all layers (as real text has): anchors and late anchors.
    middle = rng.permutation(np.arange(4, spec.context))
    anchors = np.sort(middle[: spec.n_anchors])
    shift_tokens = np.sort(middle[spec.n_anchors : spec.n_anchors + spec.n_shift_tokens])
    shift_step = spec.context + int(round(spec.shift_at * spec.steps))

    q = np.zeros((L, Hq, P, D), np.float32)
    k = np.zeros((L, Hkv, P, D), np.float32)
    v = np.zeros((L, Hkv, P, D), np.float32)
    for layer in range(L):
        # Deeper layers lean on the sink more, the first layer more on locality.
        depth = (layer + 1) / L
        for h in range(Hkv):
            kk = np.zeros((P, D))
            # rotary part: unit pairs at angle 0, rotated by position
            kk[:, :n_rot] = _rotate(np.tile([1.0, 0.0], (P, N_ROPE_PAIRS, 1)), pos, theta).reshape(
                P, n_rot
            )
            kk[0, c_sink] = sqrt_d  # the sink direction
            kk[anchors, c_anchor + np.arange(spec.n_anchors)] = sqrt_d
            kk[shift_tokens, c_shift + np.arange(spec.n_shift_tokens)] = sqrt_d
            kk[:, c_out:c_rand] = spec.outlier_scale * rng.choice(
                [-1, 1], spec.outlier_channels
            ) + 0.1 * spec.outlier_scale * rng.standard_normal((P, spec.outlier_channels))
            kk[:, c_rand:] = rng.standard_normal((P, n_rand))
            k[layer, h] = kk
            vv = rng.standard_normal((P, D))
            vv[0] *= 0.1  # sinks carry small values
            v[layer, h] = vv
            checkpoint()
        for h in range(Hq):
            # Per-head character: some heads local, some anchor readers, all see the sink.
            mix = rng.uniform(0.6, 1.4, size=3)
            qq = np.zeros((P, D))
            local = spec.local_strength * mix[0] * (1.2 - 0.4 * depth)
            # q . k over the rotary pairs = local * sum_j w_j cos((p - i) theta_j) * sqrt_d / sqrt_d
            rot = np.tile([1.0, 0.0], (P, N_ROPE_PAIRS, 1)) * (local * rope_w * sqrt_d)[:, None]
            qq[:, :n_rot] = _rotate(rot, pos, theta).reshape(P, n_rot)
            qq[:, c_sink] = spec.sink_strength * mix[1] * (0.7 + 0.3 * depth)
            qq[:, c_anchor:c_shift] = (
                spec.anchor_strength * mix[2] * rng.uniform(0.7, 1.3, spec.n_anchors)
            )
            qq[shift_step:, c_shift:c_out] = spec.topic_shift
            # background: logit std = sparsity (random channels of q and k are independent N(0,1))
            qq[:, c_rand:] = rng.standard_normal((P, n_rand)) * (
                spec.sparsity * sqrt_d / np.sqrt(n_rand)
            )
            qq[:, c_out:c_rand] = 0.02 * rng.standard_normal((P, spec.outlier_channels))
            q[layer, h] = qq
            checkpoint()

    return Trace(
        q=q,
        k=k,
        v=v,
        context_len=spec.context,
        tokens=tuple(f"t{i}" for i in range(P)),
        query_positions=pos,
        meta={
            "source": "synthetic",
            "synthetic": spec.as_dict(),
            "anchors": anchors.tolist(),
            "shift_tokens": shift_tokens.tolist(),
            "shift_position": int(shift_step),
        },
    )
