"""`kvviz eval` (one compression spec decoding a real model vs the full cache) and
`kvviz eval-sweep` (quality against memory ratio for several methods and budgets -> CSV).

torch and transformers are imported inside the handlers only.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path

from kvviz.cli.device import device_errors
from kvviz.policies.registry import featured

DEFAULT_PROMPT_TOKENS = 206
# the featured scorers (Policy.featured), the recent window alone, and the whole-cache quantizers
DEFAULT_METHODS = ",".join((*featured(), "recent-only", "kv-8bit", "kv-4bit", "kivi-2bit", "2bit-per-token-keys"))
DEFAULT_BUDGETS = "32,64,128"


def _add_text_args(p: argparse.ArgumentParser) -> None:
    from kvviz.cli.args import integer
    from kvviz.cli.device import add_model_args
    from kvviz.decode.quality import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS

    add_model_args(p)
    p.add_argument(
        "--text-file",
        default=None,
        help="UTF-8 text: the first --prompt-tokens tokens are the prompt, the rest the "
        "continuation scored (default: kvviz's bundled English sample, ~470 tokens)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=integer(1, MAX_PROMPT_TOKENS),
        default=DEFAULT_PROMPT_TOKENS,
        help=f"prompt length in tokens: the compression point (default {DEFAULT_PROMPT_TOKENS}; at most "
        "the model's positions, and what the work budget KVVIZ_MAX_BYTES allows)",
    )
    p.add_argument(
        "--continuation-tokens",
        type=integer(1, MAX_NEW_TOKENS),
        default=None,
        help=f"continuation tokens scored (1-{MAX_NEW_TOKENS}; default: the rest of the text, at most "
        f"{MAX_NEW_TOKENS})",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")


def register(subparsers) -> None:
    from kvviz.cli.args import MAX_TOKENS, add_compression_args, integer, number_list
    from kvviz.decode.quality import MAX_NEW_TOKENS

    p = subparsers.add_parser(
        "eval",
        help="decode a real model with a compressed KV cache: perplexity, KL, top-1 vs the full cache",
        description="Teacher-forced decoding of a text's continuation with the compressed cache "
        "(eviction applied step by step at the tokens' true positions, K/V quantized "
        "with the kvviz quantizer) against the full cache on the same text.",
    )
    _add_text_args(p)
    add_compression_args(p)
    p.add_argument(
        "--greedy",
        type=integer(0, MAX_NEW_TOKENS),
        default=0,
        metavar="N",
        help="also write N greedy tokens after the prompt with both caches, side by side",
    )
    from kvviz.decode.quality import DEFAULT_QUESTION_POINT, QUESTION_POINTS

    q = p.add_argument_group("question (the context / question split)")
    q.add_argument(
        "--question",
        default=None,
        metavar="TEXT",
        help="a question after the context: the text's first --prompt-tokens tokens are the context, the "
        "question follows as a paragraph of its own, and the continuation scored is the text's next tokens "
        "(with --greedy, the answer is written side by side)",
    )
    q.add_argument(
        "--compression-point",
        choices=QUESTION_POINTS,
        default=DEFAULT_QUESTION_POINT,
        help="with --question: compress the cache before the question (query-agnostic, kvpress's pipeline "
        "default: the question's tokens are then decoded through the compressed cache) or after it "
        "(query-aware: the scorer sees the question's queries, as kvpress's compress_questions=True) "
        f"(default {DEFAULT_QUESTION_POINT})",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=cmd_eval)

    s = subparsers.add_parser(
        "eval-sweep",
        help="quality vs KV memory ratio for several methods and budgets -> CSV",
        description="Every eviction method at every token budget, plus whole-cache quantizers, "
        "on the same text: perplexity, KL, top-1 and the memory ratio, one CSV row each.",
    )
    _add_text_args(s)
    s.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated: eviction methods (streaming, recent-only, h2o, tova, snapkv, knorm, "
        "oracle, every other scorer by its name, an allocation over one as adakv-snapkv or pyramid-knorm, "
        "merged evicted values as merge-snapkv) run at every budget; quantizers (kv-8bit, kv-4bit, kivi-2bit, "
        "2bit-per-token-keys, and the serving formats fp16, fp8-e4m3-tensor / -head / -token, "
        "fp8-e5m2-head, nvfp4, mxfp4, nvfp4-rotated, kivi-2bit-rotated, "
        "2bit-per-token-keys-rotated, hf-qc-4bit, hf-qc-2bit) once "
        f"(default {DEFAULT_METHODS})",
    )
    s.add_argument(
        "--budgets",
        type=number_list(int, 8, MAX_TOKENS, "32,64,128"),
        default=DEFAULT_BUDGETS,
        help=f"token budgets, each at least 8 (4 sinks + a window) (default {DEFAULT_BUDGETS})",
    )
    s.add_argument("--out", help="CSV file (default: standard output)")
    s.set_defaults(func=cmd_eval_sweep)


def _read_text(path: str | None) -> str:
    from kvviz.decode.quality import sample_text
    from kvviz.models import ModelError

    if path is None:
        return sample_text()
    f = Path(path)
    if not f.is_file():
        raise ModelError(f"text file not found: {f}")
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{f} is not a UTF-8 text file") from None


def _progress(enabled: bool):
    if not enabled:
        return None

    def say(fraction: float, message: str) -> None:
        sys.stderr.write(f"\r[{fraction:4.0%}] {message:<60}")
        sys.stderr.flush()

    return say


def _prepare(a: argparse.Namespace):
    """(model, tokenizer, reference) with the lengths checked before the model loads."""
    from kvviz.cli.device import load_from_args
    from kvviz.decode.quality import check_lengths, reference
    from kvviz.spec import SpecError

    text = _read_text(a.text_file)
    if not text.strip():
        raise SpecError("the text is empty")
    question = getattr(a, "question", None)
    if question is not None and not question.strip():
        raise SpecError("--question is empty; give the question's text, or leave the flag out")
    check_lengths(10**9, a.prompt_tokens, a.continuation_tokens)  # caps, before the slow load
    say = _progress(not a.quiet)
    model, tokenizer, _ = load_from_args(a, progress=say)
    ref = reference(model, tokenizer, text, a.prompt_tokens, a.continuation_tokens, question)
    return model, tokenizer, ref, say


@device_errors
def cmd_eval(a: argparse.Namespace) -> int:
    from kvviz.cli.args import _json_safe, spec_from_args
    from kvviz.decode.quality import evaluate
    from kvviz.decode.sidebyside import side_by_side

    spec = spec_from_args(a)
    if spec.quant_model == "noise":
        from kvviz.spec import SpecError

        raise SpecError(
            "--quant-model noise is the handbook's attention-row stand-in; "
            "on a real model kvviz eval quantizes the real K/V (use --bits)"
        )
    model, tokenizer, ref, say = _prepare(a)
    q = evaluate(model, ref, spec, progress=say, question_point=a.compression_point)
    pair = None
    if a.greedy:
        pair = side_by_side(
            model,
            tokenizer,
            list(ref.ids[: ref.prompt_len]),
            spec,
            a.greedy,
            progress=say,
            prefix=ref.prefill,
            compress_at=ref.compression_point(a.compression_point),
        )
    if say:
        sys.stderr.write("\r" + " " * 70 + "\r")
    out = q.as_dict()
    out["per_token"] = {
        "tokens": list(q.tokens),
        "kl": q.kl.tolist(),
        "nll": q.nll.tolist(),
        "nll_full": q.nll_full.tolist(),
    }
    if pair is not None:
        out["greedy"] = {
            "full": pair.full_text,
            "compressed": pair.compressed_text,
            "first_divergence": pair.first_divergence,
        }
    if a.json:
        json.dump(_json_safe(out), sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(format_eval(q, pair))
    return 0


def format_eval(q, pair=None) -> str:
    d = q.as_dict()
    lines = [
        f"spec: {q.spec.label()}",
        f"text: {d['prompt_tokens']}-token prompt, {d['continuation_tokens']} continuation tokens scored "
        + (
            "(teacher-forced; the first is predicted by the prefill)"
            if d["compressed_at"] == d["prompt_tokens"]
            else "(teacher-forced through the compressed cache)"
        ),
        "",
        f"  perplexity              {d['perplexity']:10.3f}   (full cache {d['perplexity_full']:.3f}, "
        f"ratio {d['perplexity_ratio']:.3f})",
        f"  next-token KL(full || compressed) {d['kl_mean']:.4f} mean nats/token over the vocabulary "
        f"(max {d['kl_max']:.4f})",
        f"  top-1 agreement         {d['top1_agreement']:10.3f}",
        f"  KV cache                {d['kv_bytes']:10,.0f} B of {d['kv_bytes_full']:,.0f} B (16-bit), "
        f"{d['compression_ratio']:.2f}x smaller; {d['kept_tokens']} of {d['total_tokens']} tokens kept",
        f"  time                    {d['seconds']:10.2f} s",
    ]
    if d["question_tokens"]:
        before = d["compressed_at"] < d["prompt_tokens"]
        lines.insert(
            2,
            f"question: the prompt's last {d['question_tokens']} tokens; the cache is compressed "
            + (
                f"before it (at token {d['compressed_at']}: query-agnostic), then the question is decoded through it"
                if before
                else "after it (at the prompt's end: query-aware, the scorer sees the question)"
            ),
        )
    if pair is not None:
        mark = "identical" if pair.first_divergence is None else f"first divergence at token {pair.first_divergence}"
        lines += [
            "",
            f"greedy continuation ({mark}):",
            "  full:       " + _marked(pair.full_tokens, pair.first_divergence),
            "  compressed: " + _marked(pair.compressed_tokens, pair.first_divergence),
        ]
    return "\n".join(lines)


def _marked(tokens, at) -> str:
    text = "".join(tokens) if at is None else "".join(tokens[:at]) + " >>>" + "".join(tokens[at:])
    return text.replace("\n", "\\n")


@device_errors
def cmd_eval_sweep(a: argparse.Namespace) -> int:
    from kvviz.decode.eval_sweep import SWEEP_FIELDS, sweep
    from kvviz.spec import SpecError

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    budgets = a.budgets  # checked by its argparse type
    from kvviz.decode.eval_sweep import QUANT_METHODS, SWEEP_METHODS

    bad = [m for m in methods if m not in SWEEP_METHODS and m not in QUANT_METHODS]
    if bad:
        raise SpecError(f"unknown method {bad[0]!r}; choose from {', '.join([*SWEEP_METHODS, *QUANT_METHODS])}")
    model, _, ref, say = _prepare(a)
    rows = sweep(model, ref, methods, budgets, progress=say)
    if say:
        sys.stderr.write("\r" + " " * 70 + "\r")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(SWEEP_FIELDS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else v) for k, v in r.items()})
    if a.out:
        Path(a.out).write_text(buf.getvalue())
        print(f"wrote {len(rows)} rows to {a.out}", file=sys.stderr)
    else:
        sys.stdout.write(buf.getvalue())
    return 0
