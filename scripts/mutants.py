"""Mutation testing of kvviz's core, one module at a time: `make mutants` (or MUTANTS="kvviz/x.py" make mutants).

mutmut (requirements-dev.txt; settings in pyproject.toml [tool.mutmut]) changes one small thing in a
function (an operator, a constant, an argument) and runs the fast tests that cover that function: a
test that fails has killed the mutant; a mutant no test notices has survived. For each module this
prints the mutants made, killed, survived, timed out and those no test reaches, the score
killed / (made - equivalent) (a mutant no test reaches is not killed), and the survivors and
unreached mutants that are not in EQUIVALENT. Property tests run with the
derandomized `ci` hypothesis profile, so a run is reproducible. CPU-heavy: `make mutants` runs it
niced, one module after another; the results stay in mutants/ (git-ignored) and a second run only
retests what changed.

Usage: python scripts/mutants.py [kvviz/module.py ...]   (no argument: the modules in MUTANTS below)
       python scripts/mutants.py --report [kvviz/module.py ...]   (the stored results, nothing run)
Rerun chosen mutants after adding a test: python -m mutmut run NAME ... (then --report).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = [
    "kvviz/metrics.py",
    "kvviz/quant/integer.py",
    "kvviz/policies/select.py",
    "kvviz/policies/h2o.py",
    "kvviz/policies/base.py",
    "kvviz/quant/formats.py",
    "kvviz/policies/allocation.py",
    "kvviz/engine.py",
    "kvviz/rows.py",
    "kvviz/quant/base.py",
    "kvviz/quant/fp8.py",
    "kvviz/quant/minifloat.py",
    "kvviz/quant/mxfp4.py",
    "kvviz/quant/nvfp4.py",
    "kvviz/quant/rotation.py",
    "kvviz/policies/expected_attention.py",
    "kvviz/policies/registry.py",
    "kvviz/policies/knorm.py",
    "kvviz/policies/streaming.py",
    "kvviz/policies/random.py",
    "kvviz/policies/tova.py",
    "kvviz/policies/oracle.py",
    "kvviz/policies/keydiff.py",
    "kvviz/policies/snapkv.py",
    "kvviz/policies/quest.py",
    "kvviz/policies/chunkkv.py",
    "kvviz/policies/reads.py",
]

# Reasons several modules share (numpy details no input can tell apart)
_NEG = "reshape(..., -2): numpy takes any negative size as the unknown one"
_AS_F64 = "astype(None) is float64, the dtype given"
_CAPITALS = "einsum subscripts in capitals: the same contraction"

# Mutants that cannot change behaviour, with the reason (mutmut's names: module.function__mutmut_N).
# A survivor that is not here is a missing test.
EQUIVALENT: dict[str, str] = {
    "kvviz.metrics.x_divergences__mutmut_9": _CAPITALS,
    "kvviz.metrics.x_divergences__mutmut_24": _CAPITALS,
    "kvviz.metrics.x_divergences__mutmut_37": "np.log(mid, out=None): a new array instead of in place, same values",
    "kvviz.metrics.x_divergences__mutmut_39": "np.log(mid) without out=: a new array instead of in place, same values",
    "kvviz.metrics.x_divergences__mutmut_63": _CAPITALS,
    "kvviz.metrics.x_divergences__mutmut_72": _CAPITALS,
    "kvviz.metrics.x_row_metrics_batch__mutmut_13": "`or` for `and`: the engine, its one caller, passes both "
    "outputs or neither",
    "kvviz.metrics.x_row_metrics_batch__mutmut_28": _CAPITALS,
    "kvviz.metrics.x_row_metrics_batch__mutmut_38": _CAPITALS,
    "kvviz.metrics.x_row_metrics_batch__mutmut_48": _CAPITALS,
    "kvviz.metrics.x_row_metrics_batch__mutmut_57": _CAPITALS,
    "kvviz.metrics.x_spread__mutmut_15": "<= for <: with every member present the NaN-aware path computes the "
    "same mean, std and N as the plain one",
    "kvviz.metrics.x_t_quantile__mutmut_3": "asarray(df, dtype=None): stdtrit and the df >= 1 test give the same "
    "for int or float df",
    "kvviz.metrics.x_t_quantile__mutmut_5": "asarray(df) without dtype: as above",
    "kvviz.metrics.x_error_split__mutmut_3": "asarray(kept, dtype=None): np.where reads any kept array (bool or "
    "0/1) by truth value, the same as after the cast to bool",
    "kvviz.metrics.x_error_split__mutmut_5": "asarray(kept) without dtype: as above",
    "kvviz.metrics.x_error_split__mutmut_37": "2.0 for 1.0 as the divisor where the kept mass is 0: every kept "
    "attention there is 0 (attention >= 0), and 0 / 2 = 0 / 1",
    "kvviz.metrics.x_concentration_curve__mutmut_32": "clip with no lower bound: ceil(x n - 1e-9) >= 0 for every "
    "fraction x in [0, 1]",
    "kvviz.metrics.x_concentration_curve__mutmut_33": "clip with no upper bound: ceil(x n - 1e-9) <= n for every "
    "fraction x in [0, 1]",
}


def _same(reason: str, prefix: str, *names: str) -> dict[str, str]:
    """One reason for several mutants of one module (names: function__mutmut_N)."""
    return {prefix + name: reason for name in names}


_INT = "kvviz.quant.integer.x_"
_SIGNATURES = "compile_kernel compiles the same signatures: "
EQUIVALENT.update(
    {
        **_same(
            "slice(None, full) / slice(full) for slice(0, full): the same slice",
            _INT,
            *(f"_blocks__mutmut_{n}" for n in (7, 9, 27, 29)),
        ),
        **_same(
            "slice(full, None) for slice(full, end): the array sliced ends at end",
            _INT,
            "_blocks__mutmut_17",
            "_blocks__mutmut_37",
        ),
        _INT + "_scale__mutmut_3": "reduce == +1 never holds: the short last axis is reduced where it is, "
        "the same values (slower)",
        **_same(
            "the branch for d_quant = 0, which needs a head of 0 channels",
            _INT,
            "quantized_extent__mutmut_44",
            "quantized_extent__mutmut_45",
        ),
        **_same(
            "another default axis name: every axis but 'channel' is 'token'",
            _INT,
            *(f"{f}__mutmut_{n}" for f in ("quantize", "quantize_kept", "quant_step") for n in (1, 2)),
        ),
        _INT + "quantize__mutmut_14": "< for <= residual: with tokens == residual the kernel copies x "
        "unquantized, the same values as returning x",
        _INT + "quantize__mutmut_29": "reshape(-2, ...): numpy takes any negative size as the unknown one",
        **_same(
            "no int64 cast of the indices: integer indices of any width index the same rows (numba "
            "compiles one more specialisation)",
            _INT,
            *(f"quantize_kept__mutmut_{n}" for n in (40, 42, 45, 47)),
        ),
        **_same("np.zeros(dtype=None) is float64 already", _INT, "quant_step__mutmut_27", "quant_step__mutmut_29"),
        **_same(
            _SIGNATURES + "another shape or bit width, or the group size quantize_kept defaults to (KIVI's 32), "
            "the same argument types",
            _INT,
            *(f"compile_kernel__mutmut_{n}" for n in (6, 23, 31)),
        ),
        **_same(
            _SIGNATURES + "another axis name for 'token': every axis but 'channel' is 'token'",
            _INT,
            "compile_kernel__mutmut_9",
            "compile_kernel__mutmut_10",
        ),
        **_same(
            _SIGNATURES + "delta=False for True (or its default), the same bool type",
            _INT,
            "compile_kernel__mutmut_24",
            "compile_kernel__mutmut_32",
        ),
        **_same(
            _SIGNATURES + "float head indices, which quantize_kept casts to int64",
            _INT,
            "compile_kernel__mutmut_26",
            "compile_kernel__mutmut_28",
        ),
    }
)


_SEL = "kvviz.policies.select.x_"
_H2O = "kvviz.policies.h2o.xǁH2Oǁ"
EQUIVALENT.update(
    {
        _SEL + "select__mutmut_47": "np.partition without axis=1: its default axis -1 is axis 1 of the (H, n) key",
        **_same(
            "the test for too many tied tokens fires as often or more (summed over every row, or compared across "
            "rows, or >= for >); trimming the ties of a row with no excess keeps them all",
            _SEL,
            *(f"select__mutmut_{n}" for n in (66, 68, 69, 71, 72)),
        ),
        _SEL + "evict_one__mutmut_21": "np.finfo(None) is float64's (deprecated in numpy 1.25, not yet an error)",
        _SEL + "evict_one__mutmut_39": "None assigned into a bool array is False",
        _SEL + "evict_one__mutmut_47": "reshape(H, -2): numpy takes any negative size as the unknown one",
        **_same(
            "context_attention(trim=None / False): the keys no row of the chunk sees come back as zeros, "
            "which add nothing to the sum (trim only skips them)",
            _H2O,
            "score__mutmut_3",
            "score__mutmut_4",
        ),
    }
)


_FMT = "kvviz.quant.formats.x_"
_ALLOC = "kvviz.policies.allocation."
_INT64 = "the fill is a Python int, so the array is int64 without the dtype"
EQUIVALENT.update(
    {
        _FMT + "residual_at__mutmut_25": "np.min of the 0-d count (one head's positions) is that count",
        _FMT + "quantize_tensor__mutmut_59": "np.array(x) copies by default: copy=True is the default",
        _FMT + "hf_quantized_cache__mutmut_18": "value_axis='token' dropped: Spec's default value_axis is 'token'",
        _FMT + "hf_quantized_cache__mutmut_22": "zero_point='float' dropped: Spec's default zero_point is 'float'",
        **_same(
            _INT64,
            _ALLOC,
            "x_pyramid_budgets__mutmut_8",
            "x_pyramid_budgets__mutmut_11",
            "xǁAdaKVǁhead_budgets__mutmut_92",
            "xǁAdaKVǁhead_budgets__mutmut_95",
        ),
        **_same(
            "the list holds Python ints (round() of a float), so the array is int64 without the dtype",
            _ALLOC,
            "x_pyramid_totals__mutmut_32",
            "x_pyramid_totals__mutmut_34",
        ),
        _ALLOC + "x_pyramid_budgets__mutmut_16": "np.full(max(n, 2))[:n]: the slice leaves n entries for n = 0 or 1",
        _ALLOC + "x_pyramid_budgets__mutmut_34": "floor(real - 1e-9): a layer floored one lower gets a fraction >= "
        "1 - 1e-9, above every other layer's (< 1 - 1e-9), so the unit of `rest` "
        "it adds goes straight back to it (0 differences over heavy < 60, "
        "L <= 32, 11 betas)",
        _ALLOC
        + "x_pyramid_totals__mutmut_9": "> for >= in the clamp: at hi == n - window the clamp sets hi to itself and "
        "lo = 2A - hi = A / beta (0 differences over 1070 such cases)",
        _ALLOC + "x_pyramid_totals__mutmut_30": "steps 1.0 for one layer: layer * steps = 0 for its only layer 0",
        _ALLOC
        + "xǁAdaKVǁhead_budgets__mutmut_14": "take < 0 for <= 0: at take 0 the floor is 0 and rest is 0, so the int64 "
        "zeros come back all the same",
        **_same(
            "np.nan_to_num's default posinf is the largest float64, the value given",
            _ALLOC,
            "xǁAdaKVǁhead_budgets__mutmut_51",
            "xǁAdaKVǁhead_budgets__mutmut_54",
        ),
        _ALLOC
        + "xǁAdaKVǁhead_budgets__mutmut_60": "np.finfo(None) is float64's (deprecated in numpy 1.25, not yet an error)",
        **_same(
            "no float64 cast: the callers pass float scores, and ranking float32 ones as they are gives the same "
            "order (+inf cast to float32 stays inf, still first; 0 differences over 3000 random cases)",
            _ALLOC,
            "xǁAdaKVǁhead_budgets__mutmut_56",
            "xǁAdaKVǁhead_budgets__mutmut_58",
        ),
        _ALLOC + "xǁAdaKVǁhead_budgets__mutmut_66": "np.argsort without axis=1: its default axis -1 is axis 1 "
        "of the (H, n) scores",
        _ALLOC
        + "xǁAdaKVǁhead_budgets__mutmut_71": "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
        _ALLOC + "xǁAdaKVǁhead_budgets__mutmut_100": "rest >= 0: at rest 0 nothing is chosen and bincount of "
        "nothing adds zeros",
        _ALLOC + "x_select_heads__mutmut_3": "every head through the per-budget loop: `select` decides each row on its "
        "own, so the rows selected apart give the same mask",
        _ALLOC
        + "x_select_heads__mutmut_9": "spec.with_(heavy=heavy[0]) where heavy[0] is spec.heavy already: the same spec",
    }
)

_BASE = "kvviz.policies.base."
_POL = _BASE + "xǁPolicyǁ"
EQUIVALENT.update(
    {
        _BASE + "xǁScoreContextǁhistory_counts__mutmut_8": "np.searchsorted's default side is 'left', the side given",
        **_same(
            _NEG,
            _BASE,
            "xǁScoreContextǁper_kv_head__mutmut_10",
            "x_group_union__mutmut_11",
            *(f"xǁPolicyǁ_simulate__mutmut_{n}" for n in (15, 38, 120, 151)),
        ),
        _BASE + "x__cache_put__mutmut_5": "OrderedDict.popitem(last=None): last is read by truth value, as False",
        _POL + "query_kept__mutmut_2": "query_reads(None, ...): the only policy with its own query_reads (Quest) "
        "reads the query and keys, never the attention; the base's returns None",
        _POL + "scores_at_compression__mutmut_34": "flags.writeable = None: numpy sets the flag by truth value, False",
        "kvviz.policies.reads.xǁSpecReadsǁ__init____mutmut_12": "a view of a view kept unwrapped: reads pass "
        "through the "
        "inner view, which notes them too; properties are "
        "evaluated on the outer view either way",
        "kvviz.policies.reads.xǁSpecReadsǁ__getattr____mutmut_6": "getattr(Spec, name) without a default: a name Spec "
        "lacks raises AttributeError either way (every field "
        "has a class-level default)",
        **_same(
            "the shared-decision shortcut taken less often (never, or only above 2 KV heads): every row of a "
            "broadcast score is the same, so selecting each row gives the rows the shortcut copies",
            _POL,
            # (93, 95, ... before the allocations moved out of keep_masks into kvviz.policies.allocation)
            *(f"keep_masks__mutmut_{n}" for n in (53, 55, 57, 58, 59, 68)),
        ),
        **_same(_AS_F64, _POL, *(f"_simulate__mutmut_{n}" for n in (18, 110, 145))),
        **_same(
            "no float64 cast of the scores a compression during decoding ranks: a cast neither reorders nor "
            "makes or breaks a tie, and `select` / `recompressed` only rank them",
            _POL,
            "scores_until__mutmut_16",
            "scores_until__mutmut_18",
        ),
        **_same(
            "np.take_along_axis's default axis (numpy >= 2.3) is -1, axis 1 of the 2-D arrays",
            _POL,
            "_simulate__mutmut_109",
            "_simulate__mutmut_163",
        ),
    }
)

_ENG = "kvviz.engine.x_"
_ROW = "kvviz.rows.x_"  # the row functions moved from engine.py to rows.py, bodies unchanged
_RECOMPUTED = (
    "the oracle recomputes the attention of heads it was given instead of taking `original`: softmax and "
    "softmax_and_log do the same arithmetic (max, exp, divide by the sum) on logit_rows of the same "
    "queries and keys"
)
EQUIVALENT.update(
    {
        **_same(
            "per_layer is a list of Python ints: np.array makes it int64 without the dtype",
            _ENG,
            "kept_counts__mutmut_30",
            "kept_counts__mutmut_32",
        ),
        **_same(
            "a fresh quantized-cache dict (on every call, or for the ragged one-head calls): the same K_hat / "
            "V_hat computed again (the shared dict only saves the work)",
            _ROW,
            *(f"evaluate_rows__mutmut_{n}" for n in (3, 71, 87, 94)),
        ),
        _ROW + "evaluate_rows__mutmut_128": "p None for Quest's whole cache: p enters only the cache key on this path "
        "(formats, which read p, are refused for Quest per query head), and the "
        "key's hash of arange(n) already tells the queries apart",
        _ROW + "evaluate_rows__mutmut_237": "kept_part(None, ...): the row only indexes a stored V_hat (at[None] adds "
        "an axis), and here only whether it is None is asked",
        **_same(
            "p_kept cast to float64 instead of the trace's float32 before o_hat = p_kept . V: the same product "
            "to float32 rounding (the cast is a speed choice; no result reads the last bits)",
            _ROW,
            "evaluate_rows__mutmut_255",
            "evaluate_rows__mutmut_269",
        ),
        _ROW + "_quantized_kept__mutmut_22": "hash(None) for the kept positions: one cache serves one trace and spec "
        "(compare; evaluate_row makes its own), where (layer, KV head, p), all in "
        "the key, decide the kept positions (Quest's whole cache: arange(p + 1))",
        **_same(
            "<= for < FULL_BITS: quantize_kept at 16 bits returns a zero K delta / V unchanged (integer.py), what "
            "skipping it gives",
            _ROW,
            "_quantized_kept__mutmut_46",
            "_quantized_kept__mutmut_64",
        ),
        _ROW + "evaluate_rows__mutmut_236": "o_hat by the first branch when tokens are evicted and V is stored exact: "
        "compressed is p_kept on the kept tokens and 0 elsewhere, so compressed . V "
        "= p_kept . V_kept (the zeros add nothing); with nothing evicted and nothing "
        "quantized the elif branch reads V at every position: the same product",
        **_same(
            "heads arrive as a list of Python ints (compare, evaluate_row) or a slice of this int array (the "
            "ragged recursion): int64 without the dtype",
            _ROW,
            "evaluate_rows__mutmut_7",
            "evaluate_rows__mutmut_9",
        ),
        **_same(_RECOMPUTED, _ROW, "evaluate_rows__mutmut_36", "_query_kept__mutmut_18", "_query_kept__mutmut_28"),
        _ROW + "evaluate_rows__mutmut_70": "kept_kv None sends each one-head call back to _query_kept, which returns "
        "this query's cached decision: the same reads and kept mask",
        _ROW + "_query_kept__mutmut_13": "rows = '': only a policy that uses the attention reads rows, and for it rows "
        "is replaced by the array; Quest (uses_attention False) ignores it",
        **_same(
            "an empty `done` of floats: len 0 skips the assignment, and np.setdiff1d(arange, empty) returns the "
            "int heads",
            _ROW,
            "_query_kept__mutmut_20",
            "_query_kept__mutmut_22",
        ),
        _ROW + "_query_kept__mutmut_50": "query_reads(None, ...): Quest, the one policy with its own reads, ranks by "
        "the query and keys and never reads the attention",
        _ROW + "_query_kept__mutmut_57": "query_kept where query_reads gave reads: Policy.query_kept returns their "
        "group_union itself (base.py), the mask the engine would build",
        _ROW + "_query_kept__mutmut_73": "name None: the key (query, eviction_key) already names the scorer, and no "
        "other score-cache entry has a None name",
        **_same(
            "kept masks are False past the query (a token that has not arrived is never kept; checked for every "
            "scorer and allocation on test_engine's trace): flatnonzero over more columns finds the same "
            "positions",
            _ROW,
            "_quantized_kept_formats__mutmut_1",
            "_quantized_kept_formats__mutmut_3",
        ),
        **_same(
            "the kept_kv-is-None branch: its one caller without a mask is Quest per query head, which Spec refuses "
            "with these formats ('Quest per query head reads a different number of tokens ...'), and with "
            "eviction off or the noise model _quantized_kept returns before it",
            _ROW,
            *(f"_quantized_kept_formats__mutmut_{n}" for n in (5, 6, 7, 8, 9)),
        ),
        **_same(
            "another tag string: the integer path's keys start with the layer, an int, so a formats key still "
            "never equals one",
            _ROW,
            "_quantized_kept_formats__mutmut_15",
            "_quantized_kept_formats__mutmut_16",
        ),
        _ROW
        + "_quantized_kept_formats__mutmut_17": "hash(None) for the kept positions: one cache serves one trace and "
        "spec (compare; evaluate_row makes its own), where (layer, p), both "
        "in the key, decide the kept positions",
        **_same(
            "quantize_tensor reads which == 'k': any other value is the values (formats.settings)",
            _ROW,
            *(f"_quantized_kept_formats__mutmut_{n}" for n in (49, 55, 56)),
        ),
        _ENG + "ensemble_members__mutmut_60": "_same_step for every seed member: where the member's trace is the "
        "primary's, _same_step(trace, trace, qi) is qi",
        **_same(
            "another order of a batch's rows (by member, by head / group size, by query: all one within a "
            "batch): evaluate_rows takes any order, one product per run of rows of one KV head (kv_runs)",
            _ENG,
            "compare__mutmut_87",
            "compare__mutmut_89",
            "compare__mutmut_90",
        ),
        **_same(
            "no shared quantized-cache dict for the batch: evaluate_rows makes a fresh one and computes the same "
            "K_hat / V_hat again",
            _ENG,
            *(f"compare__mutmut_{n}" for n in (100, 107, 109, 111)),
        ),
        **_same(
            "the spread as if some member saw fewer tokens (complete None / False): the rows are copied into a "
            "NaN-filled array, no NaN is left, and spread's NaN-aware path gives the same mean, std and N as the "
            "plain one (see metrics.x_spread__mutmut_15); the primary row has n tokens, so all(len != n) is False",
            _ENG,
            *(f"compare__mutmut_{n}" for n in (122, 124, 165, 167)),
        ),
        _ENG + "compare__mutmut_176": "counts passed where the budget is exact: kept_counts gives min(each layer's "
        "budget, n) for every head there, what memory_for counts from the budget",
        _ROW + "reasons_for__mutmut_2": "kept.shape[+1] for shape[-1]: every caller passes (rows, n) masks",
        _ENG + "head_grid__mutmut_15": "head=0 is View's default",
        _ENG + "head_grid__mutmut_19": "an ensemble of all n_q_heads heads from head 1 wraps round to every head once",
    }
)

# kvviz/policies/expected_attention.py, kvviz/policies/registry.py
_EA = "kvviz.policies.expected_attention.x_"
_QS = _EA + "query_statistics__mutmut_"
_FLOAT64 = (
    "computed in float64 instead of float32: the same maths, more exact (float32 is a speed choice, "
    "checked against a float64 reference to 1e-6; no result reads the last bits)"
)
EQUIVALENT.update(
    {
        **_same(
            "no float64 cast of the trace's frequencies: both uses multiply them by float64 positions, and "
            "widening float32 or int to float64 is exact, so every angle is the same",
            _EA,
            "rope_inv_freq__mutmut_8",
            "rope_inv_freq__mutmut_10",
        ),
        **_same(
            "np.arange(0, d, 2) of ints: divided by d it is the same float64 exponents",
            _EA,
            "rope_inv_freq__mutmut_72",
            "rope_inv_freq__mutmut_76",
        ),
        _EA + "rotate__mutmut_3": _AS_F64,
        **_same(
            "np.concatenate(axis=+1) of the 2-D (n, d/2) cos / sin is axis -1",
            _EA,
            "rotate__mutmut_12",
            "rotate__mutmut_18",
        ),
        **_same(
            "integer positions (start and horizon are ints): times the float64 frequencies they give the same "
            "float64 angles",
            _EA,
            "mean_rotation__mutmut_5",
            "mean_rotation__mutmut_8",
        ),
        "kvviz.policies.expected_attention.xǁExpectedAttentionǁscore__mutmut_67": "einsum subscripts in capitals: the "
        "same contraction",
        **_same(
            "the test for a run of rows fails more often: the rows are gathered (q[:, r]) instead of sliced, "
            "the same values",
            _QS,
            *(f"{n}" for n in (9, 10, 14, 15, 16, 18)),
        ),
        **_same(_AS_F64, _QS, "35", "61", "67"),
        **_same(_FLOAT64, _QS, "38", "46", "48"),
        **_same("astype(float32) copying or not (copy=None / True / default): the same values", _QS, "39", "41", "42"),
        _QS + "74": "the cache's name None: no other entry has it (scores use the policy's name, the engine "
        "'query-kept/...'), so the key stays distinct",
        _QS + "75": "the cache's key None for (): no other entry has this name, so the key stays distinct",
        **_same("another name for the cached statistics: no other entry uses it", _QS, "82", "83"),
        _EA + "expected_attention__mutmut_1": "chunk 1025 for 1024: the chunks only split the keys, each key's "
        "quadratic term is its own row of the products",
        **_same(_FLOAT64, _EA, "expected_attention__mutmut_44", "expected_attention__mutmut_46"),
        _EA
        + "expected_attention__mutmut_85": "reshape(..., -2, ...): numpy takes any negative size as the unknown one",
    }
)
_REG = "kvviz.policies.registry.x_"
EQUIVALENT.update(
    {
        **_same(
            "another default (None, 'XXXX', none) for getattr(policy, 'name'): every Policy has a name (the base "
            "class sets ''), so the default is never read",
            _REG,
            "as_policy__mutmut_19",
            "as_policy__mutmut_22",
            "as_policy__mutmut_25",
        ),
        **_same(
            "another default for getattr(policy, 'description'): every Policy has one (the base class sets ''), "
            "so the default is never read",
            _REG,
            "register__mutmut_26",
            "register__mutmut_29",
            "register__mutmut_32",
        ),
        _REG + "load_file__mutmut_43": "sys.modules.pop(mod_name) without a default: the entry was set just before "
        "exec_module, so it is there unless the plug-in deleted its own entry",
    }
)


# kvviz/quant/base.py, fp8.py, minifloat.py, mxfp4.py, nvfp4.py, rotation.py (base.py and rotation.py have none)
_FP8 = "kvviz.quant.fp8.x_"
_MF = "kvviz.quant.minifloat."
_MX = "kvviz.quant.mxfp4.x_"
_NV = "kvviz.quant.nvfp4.x_"
_DIV1 = "/ 1.0 for * 1.0: the same float"
EQUIVALENT.update(
    {
        # mxfp4.py
        _MX + "mxfp4_exponents__mutmut_16": "clip with no upper bound: e8m0_exponent is at most 127, so X = it - 2 is "
        "at most 125",
        _MX + "mxfp4_quantize__mutmut_15": _AS_F64,
        _MX + "mxfp4_quantize__mutmut_27": _NEG,
        _MX + "mxfp4_bytes__mutmut_4": _DIV1,
        # fp8.py
        **_same(
            "the per-token amax with no initial value: differs only for a head of 0 channels (a max over an "
            "empty channel axis)",
            _FP8,
            "fp8_scales__mutmut_38",
            "fp8_scales__mutmut_41",
        ),
        **_same(
            "np.asarray without dtype: both callers pass float64 (fp8_scales an array, nvfp4_scales a Python "
            "float), which asarray keeps (0 differences over 200 random tensors, both dtypes)",
            _FP8,
            "fp32_at_least__mutmut_3",
            "fp32_at_least__mutmut_5",
        ),
        **_same(_AS_F64, _FP8, "fp8_scales__mutmut_49", "fp32_at_least__mutmut_14", "fp8_quantize__mutmut_5"),
        # nvfp4.py
        **_same(
            "padding zeros as float64 (the array becomes float64): every caller reads the blocks as float64 next "
            "(astype, e8m0_exponent's asarray), the same values",
            _NV,
            "blocked__mutmut_13",
            "blocked__mutmut_15",
        ),
        _NV
        + "nvfp4_scales__mutmut_3": "the tensor amax with no initial value: differs only for an empty tensor, which "
        "blocked() then cannot reshape (size 0 with an unknown axis) either way",
        _NV + "nvfp4_quantize__mutmut_24": "2.0 for the divisor where s == 0: `out` takes 0 there, not the quotient",
        _NV + "nvfp4_quantize__mutmut_32": "s >= 0 in `out`: where s == 0 the rounded value times 0 is +-0, equal to "
        "the 0 given (safe is 1 there, so nothing divides by 0)",
        **_same(_AS_F64, _NV, "nvfp4_scales__mutmut_17", "nvfp4_quantize__mutmut_10"),
        **_same(_NEG, _NV, "blocked__mutmut_28", "nvfp4_quantize__mutmut_45"),
        _NV + "nvfp4_bytes__mutmut_8": _DIV1,
        # minifloat.py
        _MF + "xǁMinifloatǁvalues__mutmut_4": "3^n codes for 2^n: the extra codes have exponent fields past the "
        "format's, above max_value, and are dropped (the same set, slower)",
        **_same(
            "np.asarray without float64: on representable values (the method's domain) float16 / 32 / 64 and "
            "integer arrays give the same exponent and step parity (checked on every value of the three formats)",
            _MF,
            "xǁMinifloatǁmantissa_is_even__mutmut_4",
            "xǁMinifloatǁmantissa_is_even__mutmut_6",
        ),
        _MF + "xǁMinifloatǁmantissa_is_even__mutmut_17": _AS_F64 + ": rint gives whole numbers, whose parity % 2 reads",
        _MF + "x_e8m0_exponent__mutmut_14": "x >= 0 inside: frexp(0) is read only where x > 0 (the outer where gives "
        "-127 for x <= 0)",
        _MF + "x_e8m0_exponent__mutmut_16": "2.0 for x <= 0 inside: the outer where gives -127 there",
    }
)


# kvviz/policies: knorm, streaming, random, tova, oracle, keydiff, snapkv, quest, chunkkv
_STREAM = "kvviz.policies.streaming.xǁStreamingǁ"
_TOVA = "kvviz.policies.tova.xǁTOVAǁ"
EQUIVALENT.update(
    {
        **_same(
            "int positions instead of float64: both readers of `score` (scores_at_compression, the decode cache) "
            "cast it to float64, and positions are exact there",
            _STREAM,
            "score__mutmut_3",
            "score__mutmut_5",
        ),
        **_same(
            "another fill (None, +inf) for the positions after the context: TOVA is streaming, so _simulate "
            "overwrites them with +inf before reading them, and the decode cache's trace ends at the context",
            _TOVA,
            "score__mutmut_9",
            "score__mutmut_12",
        ),
    }
)
_KD = "kvviz.policies.keydiff.xǁKeyDiffǁ"
_QUEST = "kvviz.policies.quest.x"
_CHUNK = "kvviz.policies.chunkkv.x"
EQUIVALENT.update(
    {
        _KD
        + "score__mutmut_5": "float16 keys cast to float64 instead of float32: the same cosines to float32 rounding "
        "(float32 is kvpress's precision and a speed choice, not another rule)",
        _KD + "score__mutmut_19": _CAPITALS,
        **_same(
            "the anchor times a positive constant (c^2, or 2): cos(k, s a) = cos(k, a); only an anchor under the "
            "1e-12 floor (normalised keys cancelling, the cosine undefined) would scale a head's scores, all alike "
            "(0 differences in the masks of 48 KeyDiff / ChunkKV cases)",
            _KD,
            "score__mutmut_23",
            "score__mutmut_29",
        ),
        **_same(_AS_F64, _KD, "score__mutmut_49", "score__mutmut_56"),
        _KD + "score__mutmut_50": "norm over axis +1 for -1: the anchor is 2-D (kv_heads, d)",
        **_same(
            "the window's float32 attention rows summed in float32 instead of float64: votes equal to float32 "
            "rounding, the precision of the attention rows themselves",
            "kvviz.policies.snapkv.xǁSnapKVǁ",
            "score__mutmut_25",
            "score__mutmut_27",
        ),
        **_same(_NEG, _QUEST, "_page_bounds__mutmut_18", "_page_bounds__mutmut_126", "ǁQuestǁquery_scores__mutmut_19"),
        _QUEST + "_page_bounds__mutmut_24": "the min / max loop from j = 0: lo and hi start as page row 0, and "
        "min(x, x) = x",
        **_same(_AS_F64, _QUEST, *(f"_page_bounds__mutmut_{n}" for n in (71, 88, 103))),
        **_same(
            "no float64 cast: chunk_scores' one caller passes float64 token scores (scores_at_compression casts "
            "them; the max + 1 pad keeps them float64)",
            _CHUNK,
            "_chunk_scores__mutmut_4",
            "_chunk_scores__mutmut_6",
        ),
        _CHUNK + "_chunk_scores__mutmut_18": _NEG,
        _CHUNK + "ǁChunkKVǁscore__mutmut_25": "pad 1 + 1 for 0 + 1 where the inner scorer ranks nothing: every token "
        "gets the same pad either way, all chunks tie, and only the order is read "
        "(0 differences in the masks of 384 cases)",
        _CHUNK + "ǁChunkKVǁcompression_kept__mutmut_31": "numpy reads the sort kind case-insensitively: 'STABLE' is "
        "'stable'",
    }
)


def _mutmut(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "KVVIZ_WARMUP": "0"}
    if args[:1] == ("run",) and os.environ.get("MUTMUT_CHILDREN"):  # e.g. 1 on a shared machine
        args = ("run", "--max-children", os.environ["MUTMUT_CHILDREN"], *args[1:])
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=ROOT, env=env, text=True, capture_output=True)


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def results() -> dict[str, str]:
    """Every mutant's status from mutmut's stored results (killed ones too)."""
    out = _mutmut("results", "--all", "true").stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\w.]+__mutmut_\d+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def report(path: str, status: dict[str, str], seconds: float | None = None) -> float | None:
    prefix = _module(path) + "."
    mine = {k: v for k, v in status.items() if k.startswith(prefix)}
    count = lambda s: sum(v == s for v in mine.values())  # noqa: E731
    killed_ = ("killed", "timeout", "segfault")  # a test run that crashed has noticed the mutant too
    # a mutant listed as equivalent that a test kills is not equivalent: it counts as killed (and is flagged)
    equivalent = [k for k in mine if k in EQUIVALENT and mine[k] not in killed_]
    wrongly_listed = [k for k in mine if k in EQUIVALENT and mine[k] in killed_]
    survivors = [k for k, v in mine.items() if v in ("survived", "no tests") and k not in EQUIVALENT]
    judged = len(mine) - len(equivalent)  # a mutant no test reaches counts as not killed
    killed = sum(count(s) for s in killed_)
    score = killed / judged if judged else None
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    print(
        f"{path}: {len(mine)} mutants{took}: {count('killed')} killed, {count('timeout')} timed out, "
        + (f"{count('segfault')} crashed the tests, " if count("segfault") else "")
        + f"{count('survived')} survived, {count('no tests')} reached by no test ({len(equivalent)} of these "
        f"equivalent)"
        + (f"; score {100 * score:.1f}% of the non-equivalent mutants killed" if score is not None else "")
    )
    for k in survivors:
        print(f"    {mine[k]}: {k}")
    for k in equivalent:
        print(f"    equivalent: {k} ({EQUIVALENT[k]})")
    for k in wrongly_listed:
        print(f"    {mine[k]}, yet listed in EQUIVALENT (remove it there): {k}")
    for k, v in mine.items():
        if v not in ("killed", "survived", "timeout", "segfault", "no tests"):
            print(f"    {v}: {k}")
    return score


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"]:  # the stored results only: run nothing
        status = results()
        for path in argv[1:] or MUTANTS:
            report(path, status)
        return 0
    paths = argv or MUTANTS
    scores = {}
    for path in paths:
        if not (ROOT / path).is_file():
            print(f"no such module: {path}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        run = _mutmut("run", _module(path) + ".*")
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
            print(f"mutmut failed on {path} (exit {run.returncode})", file=sys.stderr)
            return run.returncode
        scores[path] = report(path, results(), time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
