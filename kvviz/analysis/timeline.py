"""The decode timeline: which tokens each policy holds at every decode step, and what it costs.

For a trace with later queries (decode steps), one layer and one KV head:

    kept[s, i]     policy holds token i when the query of step s reads the cache
                   (Policy.keep_masks: H2O and TOVA streaming step by step, one-shot
                   policies from their compression-time scores; the oracle re-selects
                   every step from that step's own attention - the bound)
    a[s, i]        the full cache's attention of step s, averaged over the query heads
                   of the KV group: a = mean_h softmax(q_h . K^T / sqrt(d))
    regret[s]    = sum_i a[s, i] * [i <= p_s and not kept[s, i]]
                   the attention mass the full model put on tokens already evicted
    missed[s, i] = a[s, i] >= need and not kept[s, i]
                   a token the model needed at step s that was no longer in the cache

With Spec.compress_every = N the one-shot scorers compress again after every N-th decode
step's query (kvviz.policies.recompress): `compressed_after` lists those steps. H2O, TOVA and
the oracle decide at every step anyway and run as they always do (the timeline says so).

"Evicted and later needed" are the tokens with any missed step: history-based eviction
threw them away, and a later query wanted them (the handbook's warning: a token ignored
for 500 steps can be needed at step 501). Pure numpy; no Streamlit, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvviz.attention import softmax, window_masks, window_start
from kvviz.engine import keep_masks, trace_bytes
from kvviz.limits import Part, Work, checkpoint
from kvviz.policies import get_policy, select
from kvviz.policies.recompress import is_due
from kvviz.policies.registry import followed_while_decoding
from kvviz.spec import Spec, SpecError
from kvviz.trace import Trace, TraceError

TIMELINE_POLICIES = followed_while_decoding()
DEFAULT_NEED = 0.02  # attention share that counts as "needed" at a step

# Cell states of the steps x tokens map (figures colour by these).
FUTURE, EVICTED, KEPT, MISSED = 0, 1, 2, 3
STATE_NAMES = {FUTURE: "not arrived yet", EVICTED: "evicted", KEPT: "kept", MISSED: "evicted but needed now"}


@dataclass(frozen=True, eq=False)
class PolicyTimeline:
    name: str
    kept: np.ndarray  # (steps, positions) bool
    regret: np.ndarray  # (steps,) full attention mass on evicted tokens
    missed: np.ndarray  # (steps, positions) bool: needed at that step but evicted
    compressed_after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # steps after whose query the cache was compressed again (Spec.compress_every), in order

    @property
    def evicted_needed(self) -> np.ndarray:
        """(positions,) bool: tokens evicted that a later step needed."""
        return self.missed.any(axis=0)

    @property
    def first_missed_step(self) -> np.ndarray:
        """(positions,) the first step each token was needed while evicted; -1 if never."""
        hit = self.missed.any(axis=0)
        return np.where(hit, self.missed.argmax(axis=0), -1)

    def states(self, positions: np.ndarray) -> np.ndarray:
        """(steps, positions) int8 cell states: FUTURE / EVICTED / KEPT / MISSED."""
        P = self.kept.shape[1]
        arrived = np.arange(P)[None, :] <= positions[:, None]
        out = np.where(arrived, EVICTED, FUTURE).astype(np.int8)
        out[self.kept] = KEPT
        out[self.missed] = MISSED
        return out

    @property
    def regret_mean(self) -> float:
        return float(self.regret.mean()) if len(self.regret) else 0.0

    def history(self, token: int, positions: np.ndarray, context_len: int) -> str:
        """One token's story under this policy: when it was evicted, when it was needed while gone.

        e.g. 'evicted at the compression point; needed at steps 17-31 while evicted'.
        """
        from kvviz.analysis.frames import ranges_text

        arrived = positions >= token
        held = self.kept[:, token] & arrived
        steps = np.flatnonzero(arrived)
        if not len(steps):
            return "not arrived within these steps"
        parts = []
        if not held[steps[0]]:
            parts.append(
                "evicted at the compression point" if token < context_len else f"evicted on arrival (step {steps[0]})"
            )
        else:
            gone = steps[~held[steps]]
            parts.append(
                f"held until step {gone[0] - 1}, evicted at step {gone[0]}" if len(gone) else "held at every step"
            )
        needed = np.flatnonzero(self.missed[:, token])
        if len(needed):
            parts.append(f"needed at step{'s' if len(needed) > 1 else ''} {ranges_text(needed)} while evicted")
        return "; ".join(parts)


@dataclass(frozen=True, eq=False)
class Timeline:
    spec: Spec  # budgets shared by all policies (scorer overridden per policy)
    layer: int
    kv_head: int
    positions: np.ndarray  # (steps,) token position of each decode step's query
    attention: np.ndarray  # (steps, positions) full-cache attention, group mean
    tokens: tuple[str, ...]
    context_len: int
    need: float
    policies: dict[str, PolicyTimeline]
    # policy -> why it cannot run with this spec
    skipped: dict[str, str] = field(default_factory=dict)
    # the model's own number of `layer` (a position in the trace; a capture may keep some layers)
    layer_number: int | None = None
    # the one-shot scorers compress again every N steps (0: once)
    compress_every: int = 0
    # policies run without spec.compress_every (they decide every step)
    decides_every_step: tuple[str, ...] = ()

    @property
    def model_layer(self) -> int:
        """The layer as the model numbers it (the position in the trace where it does not say)."""
        return self.layer if self.layer_number is None else self.layer_number

    @property
    def n_steps(self) -> int:
        return len(self.positions)

    def step_rows(self, step: int, labels: dict[str, str], max_tokens: int = 12) -> list[dict]:
        """One table row per policy at a decode step: regret, tokens held, and the tokens needed
        at that step but already evicted (the first `max_tokens`, then an ellipsis)."""
        rows = []
        for name, pt in self.policies.items():
            missed = np.flatnonzero(pt.missed[step])
            rows.append(
                {
                    "policy": labels.get(name, name),
                    "regret at this step": round(float(pt.regret[step]), 4),
                    "tokens held": int(pt.kept[step].sum()),
                    "needed now but evicted": ", ".join(f"{i} {self.tokens[i]!r}" for i in missed[:max_tokens])
                    + (" …" if len(missed) > max_tokens else ""),
                }
            )
        return rows

    def needed_tokens(self) -> list[int]:
        """Positions some policy evicted and a later step needed, in order."""
        needed = set()
        for pt in self.policies.values():
            needed.update(np.flatnonzero(pt.evicted_needed).tolist())
        return sorted(needed)


def full_attention(trace: Trace, layer: int, kv_head: int, query_indices: np.ndarray) -> np.ndarray:
    """(len(query_indices), positions) attention of each query, mean over the KV group's heads.

    Zero beyond the query's own position (causal), and on a sliding layer before its window.
    """
    g = trace.group_size
    heads = np.arange(kv_head * g, (kv_head + 1) * g)
    P = trace.n_positions
    out = np.zeros((len(query_indices), P))
    k = trace.k[layer, kv_head].astype(np.float64)  # (P, D)
    scale = 1.0 / np.sqrt(trace.head_dim)
    for s, qi in enumerate(query_indices):
        checkpoint()
        p = int(trace.query_positions[qi])
        if trace.logits is not None:
            logits = trace.logits[layer, heads, qi, : p + 1].astype(np.float64)  # (g, p+1)
        else:
            q = trace.q[layer, heads, qi].astype(np.float64)  # (g, D)
            logits = q @ k[: p + 1].T * scale  # (g, p+1)
        logits[:, : window_start(p, trace.layer_windows[layer])] = -np.inf  # a sliding layer's window
        out[s, : p + 1] = softmax(logits).mean(axis=0)
    return out


def policy_masks(
    trace: Trace, spec: Spec, layer: int, positions: np.ndarray, name: str, kv_head: int, attention: np.ndarray
) -> np.ndarray:
    """(steps, positions) kept masks of one policy for one KV head (a sliding layer's: its window)."""
    if trace.layer_windows[layer] is not None:
        return window_masks(trace, layer, positions)[:, kv_head]
    s = spec.with_(scorer=name)
    policy = get_policy(name)
    if policy.needs_query and (not policy.uses_attention or s.allocation != "uniform"):
        # Quest's page reads, or an allocation across heads / layers: what the engine evaluates
        from kvviz.engine import kept_at_query

        index = {int(p): i for i, p in enumerate(trace.query_positions)}
        kept = np.zeros((len(positions), trace.n_positions), dtype=bool)
        for i, p in enumerate(positions):
            kept[i, : p + 1] = kept_at_query(trace, s, layer, index[int(p)])[kv_head]
        return kept
    if policy.needs_query:
        # the bound (the oracle): top-k of this very step's attention (summed over the group = the mean here)
        kept = np.zeros((len(positions), trace.n_positions), dtype=bool)
        for i, p in enumerate(positions):
            kept[i, : p + 1] = select(attention[i, None, : p + 1], s)[0] if s.evicts else True
        return kept
    # the engine's masks: the policy under the spec's allocation
    return keep_masks(trace, s, layer, positions)[:, kv_head]


def timeline_work(trace: Trace, n_steps: int, n_policies: int) -> Work:
    """What `timeline` holds: the trace, the steps' attention, every policy's kept / evicted / missed
    masks, and one policy's kept masks over every KV head while they are computed."""
    steps, P = (n_steps, "steps"), (trace.n_positions, "positions")
    return Work(
        "this timeline",
        (
            Part("the trace", ((trace_bytes(trace), "bytes"),), item_bytes=1),
            Part("attention", (steps, P), item_bytes=8),
            Part("policy masks", ((n_policies, "policies"), (4, "masks"), steps, P), item_bytes=1),
            Part("kept masks of every KV head", (steps, (trace.n_kv_heads, "KV heads"), P), item_bytes=1),
        ),
        lower="the steps shown, the policies or the source's size",
    )


def timeline(
    trace: Trace,
    spec: Spec,
    layer: int = 0,
    kv_head: int = 0,
    policies: tuple[str, ...] = TIMELINE_POLICIES,
    need: float = DEFAULT_NEED,
    max_steps: int | None = None,
    compress_every: int = 0,
) -> Timeline:
    """Kept sets, regret and missed tokens of several policies over a trace's decode steps; the one-shot
    scorers compress again every `compress_every` decode steps (0: once, at the end of the prompt)."""
    if not trace.has_later_queries:
        raise TraceError(
            "the decode timeline needs a trace with decode steps (later queries); this one only has its prompt"
        )
    if not 0 <= layer < trace.n_layers:
        raise SpecError(f"layer {layer} does not exist: this trace has layers 0-{trace.n_layers - 1}")
    if not 0 <= kv_head < trace.n_kv_heads:
        raise SpecError(f"KV head {kv_head} does not exist: this trace has KV heads 0-{trace.n_kv_heads - 1}")
    if not spec.evicts:
        raise SpecError("set a budget (sink, recent or heavy) - without eviction every policy keeps everything")
    if not 0 < need <= 1:
        raise SpecError(f"the 'needed' threshold is an attention share in (0, 1], got {need}")
    steps = trace.later_queries
    if max_steps is not None:
        steps = steps[:max_steps]
    positions = trace.query_positions[steps].astype(np.int64)
    timeline_work(trace, len(steps), len(policies)).check()
    attn = full_attention(trace, layer, kv_head, steps)  # (S, P)
    arrived = np.arange(trace.n_positions)[None, :] <= positions[:, None]  # (S, P)
    out, skipped, once = {}, {}, []
    for name in policies:
        checkpoint()
        try:
            s = policy_spec(spec, name, compress_every)
            kept = policy_masks(trace, s, layer, positions, name, kv_head, attn)
        except SpecError as e:  # e.g. AdaKV with a streaming scorer: say why, draw the others
            skipped[name] = str(e)
            continue
        if s.compress_every != compress_every:
            once.append(name)
        evicted = arrived & ~kept
        regret = (attn * evicted).sum(axis=1)
        missed = evicted & (attn >= need)
        again = np.array(
            [
                i
                for i, p in enumerate(positions)
                if s.evicts and is_due(int(p), trace.context_len, s.compress_every) and i < len(positions) - 1
            ],
            dtype=np.int64,
        )
        out[name] = PolicyTimeline(name=name, kept=kept, regret=regret, missed=missed, compressed_after=again)
    return Timeline(
        spec=spec,
        layer=layer,
        kv_head=kv_head,
        positions=positions,
        attention=attn,
        tokens=trace.tokens,
        context_len=trace.context_len,
        need=need,
        policies=out,
        layer_number=trace.layer_numbers[layer],
        skipped=skipped,
        compress_every=compress_every,
        decides_every_step=tuple(once),
    )


def policy_spec(spec: Spec, name: str, every: int = 0) -> Spec:
    """The spec a policy runs under on the timeline: the shared one with its scorer, compressing again every
    `every` decode steps; a policy that decides at every step anyway (H2O, TOVA, the oracle, Quest)
    compresses once."""
    policy = get_policy(name)
    if every and (policy.streaming or policy.needs_query):
        return spec.with_(scorer=name, compress_every=0)
    return spec.with_(scorer=name, compress_every=every)
