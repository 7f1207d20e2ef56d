"""`kvviz needle`: the needle-in-a-haystack (passkey) grid on a real model, per policy.

    kvviz needle --model bundled --lengths 320,640,1024 --depths 0,0.25,0.5,0.75,1 \
        --scorers full,streaming,h2o,tova,snapkv,oracle --budget 0.25 [--bits 4] \
        [--question-after-compression] [--compress-every N] [--json | --out needle.csv]

torch and transformers are imported inside the handler only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvviz.cli.device import device_errors
from kvviz.spec import SCORERS, Spec


def _grid_args(p) -> None:
    """The grid's axes: lengths, depths, scorers, budgets and bits."""
    from kvviz.analysis import needle as nd

    p.add_argument(
        "--lengths",
        default=",".join(map(str, nd.DEFAULT_LENGTHS)),
        help="prompt lengths in tokens, chat template included (default %(default)s)",
    )
    p.add_argument(
        "--depths",
        default=",".join(f"{d:g}" for d in nd.DEFAULT_DEPTHS),
        help="needle depths: fractions of the haystack before it, 0 = start, 1 = just before the "
        "question (or percentages like 50%%) (default %(default)s)",
    )
    p.add_argument(
        "--scorers",
        default=",".join(nd.DEFAULT_SCORERS),
        help=f"comma-separated: full (the uncompressed cache) and any of {', '.join(SCORERS)}, or a "
        "wrapped one as adakv-snapkv, pyramid-knorm, merge-snapkv (default %(default)s)",
    )
    p.add_argument(
        "--budget",
        default=str(nd.DEFAULT_BUDGET),
        help="cache budget as a fraction of the prompt's tokens, or several comma-separated (default %(default)s)",
    )
    p.add_argument("--bits", default="16", help="K/V bits for every cell, 1-8 or 16 = off, or several (default 16)")


def register(subparsers) -> None:
    from kvviz.analysis import needle as nd
    from kvviz.cli.args import MAX_SEED, integer
    from kvviz.cli.device import add_model_args

    p = subparsers.add_parser(
        "needle",
        help="needle-in-a-haystack grid: does each policy still find the pass key, and where was it lost",
        description="A pass key hidden at each depth of a filler haystack of each length; the full cache and "
        "every policy answer it greedily through the Model lab's compressed decoding (true "
        "positions). Per cell: right or not, the answer, the share of needle tokens kept per "
        "layer x KV head, and the attention the full model wanted on the needle. Cells are "
        "cached on disk, so a rerun is instant.",
    )
    add_model_args(p)
    _grid_args(p)
    p.add_argument(
        "--question-after-compression",
        action="store_true",
        help="query-agnostic: compress right after the haystack, then feed the question through the "
        "compressed cache, as kvpress's pipeline does by default (default here: compress after the "
        "question, kvpress's compress_questions=True)",
    )
    from kvviz.cli.args import add_setting_arg
    from kvviz.settings import SETTINGS

    add_setting_arg(p, SETTINGS["compress_every"])  # the one-shot scorers' cells (SnapKV, ...)
    p.add_argument(
        "--new-tokens",
        type=integer(1, 64),
        default=nd.DEFAULT_NEW_TOKENS,
        help="greedy answer tokens, 1-64 (default 8)",
    )
    p.add_argument(
        "--seed", type=integer(0, MAX_SEED), default=nd.DEFAULT_SEED, help="seed of the pass keys (default 0)"
    )
    p.add_argument(
        "--haystack",
        default="filler",
        choices=nd.HAYSTACKS,
        help="filler (the classic repeated sentences) or sample (kvviz's bundled English text)",
    )
    p.add_argument("--no-cache", action="store_true", help="recompute every cell (and overwrite the cache)")
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json",
        action="store_true",
        help='print {"model": ..., "settings": {...}, "cells": [...]} instead of the grid',
    )
    out.add_argument("--out", help="write one CSV row per cell to this file")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_needle)


def _list(text: str, kind, what: str, example: str) -> list:
    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        from kvviz.spec import SpecError

        raise SpecError(f"--{what} takes comma-separated values like {example}, got {text!r}")
    return values


def _depth(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def parse(a: argparse.Namespace):
    """The checked GridRequest, before any model loads."""
    from kvviz.analysis import needle as nd
    from kvviz.spec import SpecError

    lengths = _list(a.lengths, int, "lengths", "320,640,1024")
    depths = _list(a.depths, _depth, "depths", "0,0.5,1 or 0%,50%,100%")
    scorers = [s.strip() for s in a.scorers.split(",") if s.strip()]
    budgets = _list(a.budget, float, "budget", "0.25")
    bits = _list(a.bits, int, "bits", "16 or 4")
    bad = [s for s in scorers if s not in nd.SCORER_NAMES]
    if bad or not scorers:
        raise SpecError(f"unknown scorer {bad[0] if bad else a.scorers!r}; choose from {', '.join(nd.SCORER_NAMES)}")
    if any(not 0 <= d <= 1 for d in depths):
        raise SpecError("depths are fractions of the haystack in [0, 1] (or percentages 0%-100%)")
    if not 1 <= min(lengths) <= max(lengths) <= nd.MAX_LENGTH:
        bad = next(n for n in lengths if not 1 <= n <= nd.MAX_LENGTH)
        raise SpecError(
            f"--lengths are token counts of 1-{nd.MAX_LENGTH:,} (and at most the model's positions), got {bad:,}"
        )
    for b in budgets:
        nd.budget_tokens(b, 1000)
    for b in bits:
        Spec(key_bits=b, value_bits=b)
    request = nd.GridRequest(
        lengths=lengths,
        depths=depths,
        scorers=scorers,
        budgets=budgets,
        bits=bits,
        question_after_compression=a.question_after_compression,
        compress_every=a.compress_every,
        new_tokens=a.new_tokens,
        seed=a.seed,
        haystack=a.haystack,
    )
    request.check()
    return request


def model_id(a: argparse.Namespace) -> str:
    """What the needle cache keys cells by: the model, and its dtype when not float32 (a bfloat16 model
    answers differently). The device is not part of it: the same dtype gives the same cells, to rounding."""
    return a.model if a.dtype == "float32" else f"{a.model} ({a.dtype})"


@device_errors
def cmd_needle(a: argparse.Namespace) -> int:
    import time

    from kvviz.analysis import needle as nd
    from kvviz.cli.args import _json_safe
    from kvviz.cli.device import load_from_args
    from kvviz.cli.evaluate import _progress

    request = parse(a)
    if not a.device_map:
        from kvviz.cli.device import check_device

        check_device(a.device)  # before any cell, cached or not
    say = _progress(not a.quiet)
    t0 = time.perf_counter()

    def load():
        model, tokenizer, _ = load_from_args(a, progress=say)
        return model, tokenizer

    stats: dict = {}
    # loads only if needed
    grid = nd.run_grid(None, None, model_id(a), request, use_cache=not a.no_cache, progress=say, stats=stats, load=load)
    if say:
        sys.stderr.write("\r" + " " * 70 + "\r")
        sys.stderr.write(
            f"{len(grid.cells)} cells: {stats['computed']} computed, {stats['cached']} from the "
            f"cache ({nd.cache_dir()}); {time.perf_counter() - t0:.1f} s\n"
        )
    if a.json:
        json.dump(_json_safe(grid.as_dict()), sys.stdout)
        sys.stdout.write("\n")
    elif a.out:
        Path(a.out).write_text(nd.to_csv(grid))
        print(f"wrote {len(grid.cells)} rows to {a.out}", file=sys.stderr)
    else:
        print(nd.format_grid(grid))
    return 0
