"""A study's cells: the product of its lists, each checked as the command that runs it would check it.

Budgets are fractions everywhere (of the tokens the evaluated query sees, as `kvviz sweep
--budgets`; of the prompt, as `kvviz needle --budget`); a budget of 1 is the full cache, one cell
with scorer / method `full` however many scorers are listed. A model study's quantizers
(kivi-2bit, nvfp4, ...) are one cell per (model, text): budget 1, their own bits.
"""

from __future__ import annotations

import hashlib
from itertools import product
from pathlib import Path

from kvviz.analysis.study.schema import MIN_MODEL_BUDGET, SAMPLE, Cell, Study, StudyError, cell_id, read_study
from kvviz.spec import FULL_BITS, Spec, SpecError

FULL = "full"


def _bits_ok(bits: list[int]) -> None:
    for b in bits:
        try:
            Spec(key_bits=b, value_bits=b)
        except SpecError as exc:
            raise StudyError(f"[grid] bits: {b}: {exc}") from None


def _fractions_ok(budgets: list[float], what: str) -> None:
    for f in budgets:
        if not 0 < f <= 1:
            raise StudyError(f"[grid] budgets: {f:g} is not a fraction in (0, 1] of {what}")


def synthetic_tokens(source: dict) -> int:
    """Tokens the evaluated (last) query of a synthetic trace sees: the context, plus the later steps."""
    return source["context"] + source["steps"] if source["steps"] else source["context"]


def text_of(study: Study, name: str) -> str:
    """A model study's text: the bundled sample, or a UTF-8 file (relative to the study file's folder)."""
    if name == SAMPLE:
        from kvviz.decode.quality import sample_text

        return sample_text()
    path = Path(study.base_dir) / name
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StudyError(
            f"[source] texts: no such file {name!r} (paths are relative to the study file's folder; "
            f"'{SAMPLE}' is the bundled text)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StudyError(f"[source] texts: cannot read {name!r} as UTF-8 text ({exc})") from None


def quant_bits(spec: Spec) -> int:
    """The nominal width of a whole-cache quantizer (its key format's)."""
    from kvviz.analysis.sweep import SWEEP_FORMATS

    return spec.key_bits if spec.key_format == "int" else SWEEP_FORMATS[spec.key_format]


def applicable(values: dict, chosen: dict) -> dict:
    """The chosen Spec-setting values that apply under `values` (setting name -> value: a cell's spec, or its
    scorer), as the app shows a setting (kvviz.settings.shown): compress_every for SnapKV, not for H2O."""
    from kvviz.settings import SETTINGS, shown

    return {k: v for k, v in chosen.items() if shown(SETTINGS[k], values)}


def model_spec(method: str, budget: float, bits: int, prompt_tokens: int, settings: dict | None = None) -> Spec:
    """A model cell's spec: `kvviz eval-sweep`'s method at round(budget x prompt) tokens, K/V at `bits`
    (keys per channel, values per token, groups of 32, as the kv-Nbit methods); a quantizer as is; then the
    grid's Spec-setting values that apply to it (`applicable`)."""
    from kvviz.decode.eval_sweep import QUANT_METHODS, SWEEP_METHODS

    if method in QUANT_METHODS:
        spec = QUANT_METHODS[method](prompt_tokens)
    else:
        spec = SWEEP_METHODS[method](int(round(budget * prompt_tokens)))
        if bits != FULL_BITS:
            spec = spec.with_(key_bits=bits, value_bits=bits, key_axis="channel", value_axis="token", group_size=32)
    extra = applicable(spec.__dict__, settings or {})
    return spec.with_(**extra) if extra else spec


def parse_study(text: str, base_dir: str | Path = ".", origin: str = "study file") -> Study:
    """A checked Study from TOML text: every key, every range, every cell (StudyError naming the key)."""
    study = read_study(text, base_dir, origin)
    check(study)
    return study


def load_study(path: str | Path) -> Study:
    p = Path(path)
    if not p.is_file():
        raise StudyError(f"no study file at {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StudyError(f"cannot read {p}: {exc}") from None
    return parse_study(text, p.parent, origin=str(p))


def check(study: Study) -> None:
    """Every key's range and every cell's spec, before anything runs (StudyError naming the key)."""
    {"synthetic": _check_synthetic, "model": _check_model, "needle": _check_needle}[study.kind](study)
    cells(study)


def _check_synthetic(study: Study) -> None:
    from kvviz.analysis.sweep import SWEEP_FORMATS, point_spec
    from kvviz.policies.registry import load_entry_points
    from kvviz.sources.synthetic import SyntheticSpec
    from kvviz.spec import scorer_names

    src, grid = study.source, study.grid
    knobs = {k: v for k, v in src.items() if k not in ("kind", "seeds", "layer", "ensemble")}
    try:
        SyntheticSpec(**knobs)
    except SpecError as exc:
        raise StudyError(f"[source] {_culprits(knobs)}: {exc}") from None
    if min(src["seeds"]) < 0:
        raise StudyError(f"[source] seeds: {min(src['seeds'])} is negative")
    if not 0 <= src["layer"] < src["layers"]:
        raise StudyError(f"[source] layer: {src['layer']} is not a layer of a {src['layers']}-layer trace")
    load_entry_points()
    bad = [s for s in grid["scorers"] if s not in scorer_names()]
    if bad:
        raise StudyError(f"[grid] scorers: unknown scorer {bad[0]!r}; choose from {', '.join(scorer_names())}")
    _fractions_ok(grid["budgets"], "the tokens the query sees")
    _bits_ok(grid["bits"])
    bad = [f for f in grid["formats"] if f not in SWEEP_FORMATS]
    if bad:
        raise StudyError(f"[grid] formats: unknown format {bad[0]!r}; choose from {', '.join(SWEEP_FORMATS)}")
    if not grid["bits"] and not grid["formats"]:
        raise StudyError("[grid] bits: give at least one bit width (or a format)")
    n = synthetic_tokens(src)
    for chosen in setting_points(grid):
        try:
            base = Spec(**chosen)
        except SpecError as exc:
            raise StudyError(f"[grid] {' / '.join(chosen)}: {exc}") from None
        for scorer in grid["scorers"]:
            for f in grid["budgets"]:
                for b, fmt in widths(grid):
                    budget = max(1, int(round(f * n)))
                    try:
                        point_spec(FULL if budget >= n else scorer, budget, b, fmt, base)
                    except SpecError as exc:
                        where = "".join(f" {k}={v}" for k, v in chosen.items())
                        raise StudyError(
                            f"[grid] the cell scorer={scorer} budget={f:g} bits={b} format={fmt}"
                            f"{where} is impossible: {exc}"
                        ) from None


def setting_points(grid: dict) -> list[dict]:
    """Every combination of the Spec-setting axes a synthetic grid lists ([{}] when it lists none)."""
    from itertools import product

    from kvviz.analysis.study.schema import setting_axes

    axes = {k: grid[k] for k in setting_axes() if grid.get(k)}
    return [dict(zip(axes, values)) for values in product(*axes.values())]


def _culprits(knobs: dict) -> str:
    """The keys whose own values break a SyntheticSpec: each set key that, put back to its default
    with the others kept, makes the pattern valid (its message names a rule, this names the key)."""
    from kvviz.sources.synthetic import SyntheticSpec

    default = SyntheticSpec()
    found = []
    for k, v in knobs.items():
        if v == getattr(default, k):
            continue
        try:
            SyntheticSpec(**{**knobs, k: getattr(default, k)})
        except SpecError:
            continue
        found.append(k)
    return " / ".join(found) or "the pattern knobs"


def widths(grid: dict) -> list[tuple[int, str]]:
    from kvviz.analysis.sweep import SWEEP_FORMATS

    return [(b, "int") for b in grid["bits"]] + [(SWEEP_FORMATS[f], f) for f in grid["formats"]]


def _check_model(study: Study) -> None:
    from kvviz.decode.eval_sweep import QUANT_METHODS, SWEEP_METHODS
    from kvviz.decode.quality import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS

    src, grid = study.source, study.grid
    _check_models(src)
    n, m = src["prompt_tokens"], src["continuation_tokens"]
    if not 1 <= n <= MAX_PROMPT_TOKENS:
        raise StudyError(f"[source] prompt_tokens: {n} is not in 1-{MAX_PROMPT_TOKENS}")
    if m is not None and not 1 <= m <= MAX_NEW_TOKENS:
        raise StudyError(f"[source] continuation_tokens: {m} is not in 1-{MAX_NEW_TOKENS}")
    for t in src["texts"]:
        if not text_of(study, t).strip():
            raise StudyError(f"[source] texts: {t!r} is empty")
    if not src["question"].strip() and grid["question_points"] != ["before-question"]:
        raise StudyError("[grid] question_points: where to compress around a question needs [source] question")
    bad = [x for x in grid["methods"] if x not in SWEEP_METHODS and x not in QUANT_METHODS]
    if bad:
        raise StudyError(
            f"[grid] methods: unknown method {bad[0]!r}; choose from {', '.join([*SWEEP_METHODS, *QUANT_METHODS])}"
        )
    evictors = [x for x in grid["methods"] if x in SWEEP_METHODS]
    if evictors and not grid["budgets"]:
        raise StudyError(f"[grid] budgets: {evictors[0]} evicts tokens: give budgets as fractions of the prompt")
    _fractions_ok(grid["budgets"], "the prompt")
    for f in grid["budgets"]:
        if evictors and round(f * n) < MIN_MODEL_BUDGET:
            raise StudyError(
                f"[grid] budgets: {f:g} of a {n}-token prompt is {round(f * n)} tokens; eviction needs "
                f"at least {MIN_MODEL_BUDGET} (4 sinks + a window)"
            )
    _bits_ok(grid["bits"])
    for chosen in setting_points(grid):
        where = "".join(f" {k}={v}" for k, v in chosen.items())
        for x in grid["methods"]:
            for f in grid["budgets"] if x in SWEEP_METHODS else [1.0]:
                for b in grid["bits"] if x in SWEEP_METHODS else [FULL_BITS]:
                    try:
                        model_spec(x, f, b, n, chosen)
                    except SpecError as exc:
                        raise StudyError(
                            f"[grid] the cell method={x} budget={f:g} bits={b}{where} is impossible: {exc}"
                        ) from None


def _check_models(src: dict) -> None:
    if any(not m.strip() for m in src["models"]):
        raise StudyError("[source] models: a model name is empty (use 'bundled', a folder, a .gguf file or a hub id)")
    if src["gpus"] < 0:
        raise StudyError(f"[source] gpus: {src['gpus']} is negative")


def _check_needle(study: Study) -> None:
    from kvviz.analysis.needle import HAYSTACKS, SCORER_NAMES, TASKS, budget_tokens, spec_for
    from kvviz.decode.eval_sweep import SWEEP_METHODS

    src, grid = study.source, study.grid
    _check_models(src)
    if min(src["lengths"]) < 1:
        raise StudyError("[source] lengths: token counts of at least 1")
    if any(not 0 <= d <= 1 for d in src["depths"]):
        raise StudyError("[source] depths: fractions of the haystack in [0, 1]")
    if not 1 <= src["new_tokens"] <= 64:
        raise StudyError(f"[source] new_tokens: {src['new_tokens']} is not in 1-64")
    if src["haystack"] not in HAYSTACKS:
        raise StudyError(f"[source] haystack: choose from {', '.join(HAYSTACKS)}")
    bad = [s for s in grid["scorers"] if s not in SCORER_NAMES and s not in SWEEP_METHODS]
    if bad:
        raise StudyError(
            f"[grid] scorers: unknown scorer {bad[0]!r}; choose from {', '.join(SCORER_NAMES)} (or an "
            "allocation over one: adakv-snapkv, pyramid-snapkv, ...)"
        )
    bad = [t for t in src["tasks"] if t not in TASKS]
    if bad:
        raise StudyError(f"[source] tasks: unknown task {bad[0]!r}; choose from {', '.join(TASKS)}")
    for f in grid["budgets"]:
        try:
            budget_tokens(f, 1000)
        except SpecError:
            raise StudyError(f"[grid] budgets: {f:g} is not a fraction in (0, 1] of the prompt") from None
    _bits_ok(grid["bits"])
    for chosen in setting_points(grid):
        for scorer in grid["scorers"]:
            extra = applicable({"scorer": scorer}, chosen)
            try:
                spec_for(scorer, grid["budgets"][0], FULL_BITS, 1000).with_(**extra)
            except SpecError as exc:
                where = "".join(f" {k}={v}" for k, v in extra.items())
                raise StudyError(f"[grid] the cell scorer={scorer}{where} is impossible: {exc}") from None


def cells(study: Study) -> list[Cell]:
    """Every cell, in run order (a model's cells together, a text's / prompt's cells together)."""
    fixed = {k: v for k, v in study.fixed().items() if k != "name"}
    kind_cells = {"synthetic": _synthetic_cells, "model": _model_cells}.get(study.kind, _needle_cells)
    out: dict[str, Cell] = {}  # by id: a cell the grid names twice runs once
    for settings in kind_cells(study):
        cid = cell_id(study.kind, fixed, settings)
        out.setdefault(cid, Cell(cid, study.kind, settings))
    return list(out.values())


def _synthetic_cells(study: Study):
    """A Spec-setting axis reaches the cells whose spec it applies to (`applicable`: SnapKV's window for
    SnapKV); a cell it does not apply to is one cell, not one a value that would all give the same numbers."""
    from kvviz.analysis.sweep import point_spec

    src, grid = study.source, study.grid
    n = synthetic_tokens(src)
    for seed in src["seeds"]:
        for chosen in setting_points(grid):
            base = Spec(**chosen)
            for scorer in grid["scorers"]:
                for f in grid["budgets"]:
                    budget = max(1, int(round(f * n)))
                    full = budget >= n
                    for b, fmt in widths(grid):
                        spec = point_spec(FULL if full else scorer, budget, b, fmt, base)
                        yield {
                            "seed": seed,
                            "scorer": FULL if full else scorer,
                            "budget": 1.0 if full else f,
                            "bits": b,
                            "format": fmt,
                            **applicable(spec.__dict__, chosen),
                        }


def _model_cells(study: Study):
    """A quantizer runs once per text (its budget 1.0, its own bits); an eviction method at every budget and
    bit width; with a question, each cell says where it compressed (without one there is one place)."""
    from kvviz.decode.eval_sweep import SWEEP_METHODS

    src, grid = study.source, study.grid
    n = src["prompt_tokens"]
    points = [{"question_point": p} for p in grid["question_points"]] if src["question"].strip() else [{}]
    for model in src["models"]:
        for text in src["texts"]:
            sha = hashlib.sha256(text_of(study, text).encode("utf-8")).hexdigest()
            for chosen, point in product(setting_points(grid), points):
                for method in grid["methods"]:
                    runs = (
                        [(f, b) for f in grid["budgets"] for b in grid["bits"]]
                        if method in SWEEP_METHODS
                        else [(1.0, None)]
                    )
                    for f, b in runs:
                        spec = model_spec(method, f, FULL_BITS if b is None else b, n)
                        yield {
                            "model": model,
                            "text": text,
                            "text_sha256": sha,
                            "method": method,
                            "budget": f,
                            "bits": quant_bits(spec) if b is None else b,
                            **applicable(spec.__dict__, chosen),
                            **point,
                        }


def _needle_cells(study: Study):
    """The task and the protocol are columns only where the study lists them (the ids of a plain pass-key
    study stay as they were)."""
    src, grid = study.source, study.grid
    tasks = [{} if t == "passkey" else {"task": t} for t in src["tasks"]]
    protocols = [{"protocol": p} for p in grid["protocols"]] or [{}]
    for model, task, protocol in product(src["models"], tasks, protocols):
        for length, depth in product(src["lengths"], src["depths"]):
            for chosen in setting_points(grid):
                for scorer in grid["scorers"]:
                    extra = applicable({"scorer": scorer}, chosen)
                    for f, b in product((1.0,) if scorer == FULL else grid["budgets"], grid["bits"]):
                        yield {
                            "model": model,
                            **task,
                            **protocol,
                            "length": length,
                            "depth": depth,
                            "scorer": scorer,
                            "budget": f,
                            "bits": b,
                            **extra,
                        }
