"""The real-model side: a compressed KV cache inside a transformers model, the decode loops,
quality against the full-cache reference, and the Model lab's run.

    cache       CompressedCache: one run's K/V, kept sets, quantization, the policy's decisions
    attend      its attention over what is kept (delete / mask modes), teacher forcing in one pass
    ragged      PyramidCache / RaggedCache: budgets that differ by layer or by head (AdaKV, PyramidKV)
    place       where a cache lives (the model's device and dtype) and what crosses to the host
    devquant    the integer (KIVI) quantizer in torch, on the cache's device (= kvviz.quant.quantize)
    hook        the attention function that plugs a cache into a transformers model
    loop        prefill, decode, decode_many (one batch, a cache a row), plain_decode
    quality     the teacher-forced reference, perplexity / KL / top-1
    sidebyside  greedy text of the full and the compressed cache side by side, where they part
    eval_sweep  `kvviz eval-sweep`: named methods x budgets
    labsettings what a Model lab run is asked (LabSettings, the page's defaults), one pass or steps
    labstore    what Model lab runs leave: results as JSON on disk, the times runs took (the estimate)
    lab         the Model lab's run (the full-cache side kept per text) and the precomputed default

May import: the core, policies, quant, models. torch and transformers only inside functions.
"""

from kvviz.decode.attend import MODES
from kvviz.decode.cache import CompressedCache
from kvviz.decode.eval_sweep import QUANT_METHODS, SWEEP_FIELDS, SWEEP_METHODS, sweep
from kvviz.decode.loop import Prefill, decode, decode_many, masked_reference_logits, plain_decode, prefill
from kvviz.decode.quality import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    SAMPLE_TEXT_FILE,
    Quality,
    Reference,
    check_lengths,
    evaluate,
    quality_from,
    reference,
    sample_text,
    token_strings,
    tokenize,
)
from kvviz.decode.sidebyside import SideBySide, first_divergence, greedy, side_by_side

__all__ = [
    "CompressedCache",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_TOKENS",
    "MODES",
    "Prefill",
    "QUANT_METHODS",
    "Quality",
    "Reference",
    "SAMPLE_TEXT_FILE",
    "SWEEP_FIELDS",
    "SWEEP_METHODS",
    "SideBySide",
    "check_lengths",
    "decode",
    "decode_many",
    "evaluate",
    "first_divergence",
    "greedy",
    "masked_reference_logits",
    "plain_decode",
    "prefill",
    "quality_from",
    "reference",
    "sample_text",
    "side_by_side",
    "sweep",
    "token_strings",
    "tokenize",
]
