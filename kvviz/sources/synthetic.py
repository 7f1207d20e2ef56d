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
                Part("queries", ((self.layers, "layers"), (self.q_heads, "query heads"), positions, dims)),
                Part(
                    "keys and values", ((2, ""), (self.layers, "layers"), (self.kv_heads, "KV heads"), positions, dims)
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
        raise SpecError(f"head dim {s.head_dim} is too small for these knobs; needs at least {reserved}")
    if s.n_anchors + s.n_shift_tokens > s.context // 2:
        raise SpecError("too many anchor / topic-shift tokens for this context length")
    if s.local_width <= 0 or not 0 <= s.shift_at <= 1:
        raise SpecError("locality width must be positive and the shift point between 0 and 1")
    values = (s.sink_strength, s.local_strength, s.anchor_strength, s.sparsity, s.topic_shift, s.outlier_scale)
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


@dataclass(frozen=True)
class _Layout:
    """The head dimension's channels, [rotary pairs | sink | anchors | shift anchors | outliers | random],
    and the token roles every layer shares (as real text has): anchors and late anchors."""

    spec: SyntheticSpec
    theta: np.ndarray
    rope_w: np.ndarray
    anchors: np.ndarray
    shift_tokens: np.ndarray
    shift_step: int

    @property
    def n_rot(self) -> int:
        return 2 * N_ROPE_PAIRS

    @property
    def c_sink(self) -> int:
        return self.n_rot

    @property
    def c_anchor(self) -> int:
        return self.c_sink + 1

    @property
    def c_shift(self) -> int:
        return self.c_anchor + self.spec.n_anchors

    @property
    def c_out(self) -> int:
        return self.c_shift + self.spec.n_shift_tokens

    @property
    def c_rand(self) -> int:
        return self.c_out + self.spec.outlier_channels


def _key_value_head(rng, spec: SyntheticSpec, at: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """One KV head's keys and values (P, D): rotary pairs at angle 0 rotated by position, the sink direction
    on token 0, each anchor its own channel, outlier channels, random channels; small values on the sink."""
    P, D = spec.context + spec.steps, spec.head_dim
    sqrt_d, pos = np.sqrt(D), np.arange(P)
    kk = np.zeros((P, D))
    unit_pairs = np.tile([1.0, 0.0], (P, N_ROPE_PAIRS, 1))
    kk[:, : at.n_rot] = _rotate(unit_pairs, pos, at.theta).reshape(P, at.n_rot)
    kk[0, at.c_sink] = sqrt_d  # the sink direction
    kk[at.anchors, at.c_anchor + np.arange(spec.n_anchors)] = sqrt_d
    kk[at.shift_tokens, at.c_shift + np.arange(spec.n_shift_tokens)] = sqrt_d
    kk[:, at.c_out : at.c_rand] = spec.outlier_scale * rng.choice(
        [-1, 1], spec.outlier_channels
    ) + 0.1 * spec.outlier_scale * rng.standard_normal((P, spec.outlier_channels))
    kk[:, at.c_rand :] = rng.standard_normal((P, D - at.c_rand))
    vv = rng.standard_normal((P, D))
    vv[0] *= 0.1  # sinks carry small values
    return kk, vv


def _query_head(rng, spec: SyntheticSpec, at: _Layout, depth: float) -> np.ndarray:
    """One query head (P, D), with a character of its own: some heads local, some anchor readers, all see
    the sink; after the shift step the late anchors; a random background of logit std `sparsity`."""
    P, D = spec.context + spec.steps, spec.head_dim
    sqrt_d, pos, n_rand = np.sqrt(D), np.arange(P), D - at.c_rand
    mix = rng.uniform(0.6, 1.4, size=3)
    qq = np.zeros((P, D))
    local = spec.local_strength * mix[0] * (1.2 - 0.4 * depth)
    # q . k over the rotary pairs = local * sum_j w_j cos((p - i) theta_j) * sqrt_d / sqrt_d
    rot = np.tile([1.0, 0.0], (P, N_ROPE_PAIRS, 1)) * (local * at.rope_w * sqrt_d)[:, None]
    qq[:, : at.n_rot] = _rotate(rot, pos, at.theta).reshape(P, at.n_rot)
    qq[:, at.c_sink] = spec.sink_strength * mix[1] * (0.7 + 0.3 * depth)
    qq[:, at.c_anchor : at.c_shift] = spec.anchor_strength * mix[2] * rng.uniform(0.7, 1.3, spec.n_anchors)
    qq[at.shift_step :, at.c_shift : at.c_out] = spec.topic_shift
    # background: logit std = sparsity (random channels of q and k are independent N(0,1))
    qq[:, at.c_rand :] = rng.standard_normal((P, n_rand)) * (spec.sparsity * sqrt_d / np.sqrt(n_rand))
    qq[:, at.c_out : at.c_rand] = 0.02 * rng.standard_normal((P, spec.outlier_channels))
    return qq


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
    theta, rope_w = _rope_frequencies(spec.local_width)

    # Token roles, shared by all layers (as real text has): anchors and late anchors.
    middle = rng.permutation(np.arange(4, spec.context))
    anchors = np.sort(middle[: spec.n_anchors])
    shift_tokens = np.sort(middle[spec.n_anchors : spec.n_anchors + spec.n_shift_tokens])
    shift_step = spec.context + int(round(spec.shift_at * spec.steps))

    q = np.zeros((L, Hq, P, D), np.float32)
    k = np.zeros((L, Hkv, P, D), np.float32)
    v = np.zeros((L, Hkv, P, D), np.float32)
    at = _Layout(spec, theta, rope_w, anchors, shift_tokens, shift_step)
    for layer in range(L):
        # Deeper layers lean on the sink more, the first layer more on locality.
        depth = (layer + 1) / L
        for h in range(Hkv):
            k[layer, h], v[layer, h] = _key_value_head(rng, spec, at)
            checkpoint()
        for h in range(Hq):
            q[layer, h] = _query_head(rng, spec, at, depth)
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
