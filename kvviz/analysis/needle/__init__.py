"""Needle in a haystack: does the compressed cache still find what it was told, and if not, why?

A passkey prompt (Mohtashami & Jaggi's retrieval test, the form kvpress and RULER use)
hides one sentence, the needle, at a depth in a haystack of filler, then asks for it:

    <chat template> user:    There is an important info hidden inside a lot of irrelevant text. ...
                             [haystack before] The pass key is 71432. Remember it. [haystack after]
                             What is the pass key?
                    assistant: The pass key is _

`length` is the prompt's length in tokens (everything the model reads before it answers,
chat template included); `depth` is the share of the haystack before the needle (0 = at
the start, 1 = just before the question; snapped to a sentence end). The key is a
seeded random 5-digit number, different for every (length, depth).

One prefill per prompt (the full model, every layer's q, k, v kept) serves every cell:
the full cache's greedy answer, and for each (policy, budget, bits) a copy of that
prefill's cache compressed and decoded through the Model lab's own path
(kvviz.decode.cache.CompressedCache: true positions, eviction per KV head, K/V quantized
with kvviz.quant). Two places for the compression point:

    default                     after the question (kvpress's evaluation with
                                compress_questions=True; SnapKV's setting): the policy
                                scores every prompt token, the question's own queries
                                included. The first answer token is
                                predicted by the prefill itself (as in real serving); every
                                later one reads the compressed cache.
    question_after_compression  query-agnostic (kvpress's pipeline default, which compresses
                                the context only): the cache is compressed right after the
                                haystack, then the question arrives token by token through
                                the compressed cache (its own tokens are kept as decode
                                tokens are). Harder and realistic: the policy cannot know
                                what will be asked.

With compress_every = N (GridRequest; kvpress's DecodingPress) the one-shot scorers' caches (SnapKV, ...)
are compressed again every N decode steps, the question's tokens and the answer's alike; the other caches
compress as they always do.

Per cell, at the first answer step (the query at the prompt's last position, the one that
predicts the first digit of the key):
    needle_kept_by_head[l][h]  share of the needle's tokens in KV head h's cache of layer l
                               (the oracle's set is its top-k for that very query)
    wanted_mass_by_head[l][h]  attention the full model puts on the needle's tokens there,
                               the mean over the query heads sharing KV head h
    kept_mass_by_head[l][h]    the part of it on needle tokens the compressed cache still
                               holds: what the compressed cache could still give
    needle_kept, wanted_mass, kept_mass: their means over all layers x KV heads.
A cell is correct when the first run of digits in the greedy answer is exactly the key.

Every cell is cached on disk per (model, prompt ids, spec, mode, new tokens) as JSON
(never pickle), so a rerun is instant and gives the identical numbers: a fresh cell is
built from the very dictionary that is written.

torch is imported lazily (inside functions), so `import kvviz.analysis.needle` stays fast.

    prompt  the passkey prompt at a length and depth, the budget and spec of a cell
    cell    one cell run: compressed copy of the prefill, greedy answer, what each head kept
    grid    the grid run (GridRequest: what it runs)
    store   its cache on disk: where, and the keys of a prompt and a cell
    records a prompt's or a cell's JSON record, read back by its fields' types
    results the NeedleGrid a run returns, its file, the two protocols, the shipped default
    readout its CSV and text table, the cell the page opens on
"""

from kvviz.analysis.needle import cell, grid, prompt, readout, results, store
from kvviz.analysis.needle.tasks import NEEDLE_TEMPLATE, PRIMER, QUESTION, TASK_NAMES, TASKS, Task
from kvviz.analysis.needle.cell import ANSWER_FIELDS, NeedleCell, prefill, run_cell, score_answer
from kvviz.analysis.needle.grid import MAX_LENGTH, GridRequest, check_lengths, max_positions, run_grid
from kvviz.analysis.needle.readout import CSV_FIELDS, classic_failure, format_grid, loudest_head, to_csv
from kvviz.analysis.needle.results import (
    DEFAULT_FILE,
    PROTOCOL_TITLES,
    NeedleGrid,
    load_default,
    load_grids,
    protocol,
    save_grids,
)
from kvviz.analysis.needle.store import cache_dir, cell_key, prompt_key
from kvviz.analysis.needle.prompt import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_SCORERS,
    DEFAULT_SEED,
    FILLER,
    FORMAT_VERSION,
    FULL,
    HAYSTACKS,
    INSTRUCTION,
    MIN_BUDGET_TOKENS,
    SCORER_NAMES,
    NeedlePrompt,
    budget_tokens,
    build_prompt,
    haystack_text,
    min_length,
    passkey,
    spec_for,
)

__all__ = [
    "TASK_NAMES",
    "TASKS",
    "Task",
    "PROTOCOL_TITLES",
    "load_grids",
    "protocol",
    "save_grids",
    "ANSWER_FIELDS",
    "CSV_FIELDS",
    "DEFAULT_BUDGET",
    "DEFAULT_DEPTHS",
    "DEFAULT_FILE",
    "DEFAULT_LENGTHS",
    "DEFAULT_NEW_TOKENS",
    "DEFAULT_SCORERS",
    "DEFAULT_SEED",
    "FILLER",
    "FORMAT_VERSION",
    "FULL",
    "GridRequest",
    "HAYSTACKS",
    "INSTRUCTION",
    "MAX_LENGTH",
    "MIN_BUDGET_TOKENS",
    "NEEDLE_TEMPLATE",
    "NeedleCell",
    "NeedleGrid",
    "NeedlePrompt",
    "PRIMER",
    "QUESTION",
    "SCORER_NAMES",
    "budget_tokens",
    "build_prompt",
    "cache_dir",
    "cell_key",
    "check_lengths",
    "cell",
    "classic_failure",
    "format_grid",
    "grid",
    "haystack_text",
    "load_default",
    "loudest_head",
    "max_positions",
    "min_length",
    "passkey",
    "prefill",
    "prompt",
    "readout",
    "results",
    "store",
    "prompt_key",
    "run_cell",
    "run_grid",
    "score_answer",
    "spec_for",
    "to_csv",
]
