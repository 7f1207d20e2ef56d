"""Every parameter a link can carry, restored on every page: through AppTest, where a restore costs a
fraction of a second, not a browser's page load of several CPU-seconds.

The browser tests read the address bar after every single move and open one link a page in a fresh page
(tests/test_browser.py, LiveLink); these check the other direction for every parameter of the settings
table (kvviz.links.PARAMS): a link that sets it is read into the session's settings, shown by its widget
where the page has one, and kept in the address bar; a bad value of it gives its notice and the default.
"""

import re
from pathlib import Path

import pytest
from apptest_util import run_app

from kvviz.app.compression import ADVANCED
from kvviz.app.router import PAGE_FILES
from kvviz.app.store import STORE
from kvviz.links import PARAMS, Param

ROOT = Path(__file__).resolve().parents[1]
PAGES = {url: f"pages/{file}" for file, _, url in PAGE_FILES.values()}  # every page, by its address

# Values that the first value other than the default (other_value) would make impossible together, and
# the valid ones used instead: a synthetic pattern whose heads divide and whose head dim fits the knobs;
# SnapKV (its own settings apply) with PyramidKV (AdaKV needs a one-shot scorer and the integer format);
# an odd pooling kernel; bits a symmetric quantizer takes; static FP8 scales (calibration needs them);
# one-shot methods on the Trade-offs page (compressing again is for them); a cell of the shipped needle
# grid and a KV head the needle page keeps; a pin and a question.
VALID_TOGETHER = {
    "q_heads": 6,
    "kv_heads": 3,
    "context": 128,
    "steps": 8,
    "head_dim": 128,
    "scorer": "snapkv",
    "allocation": "pyramid",
    "pyr_beta": 21.0,
    "snapkv_kernel": 7,
    "bits": 4,
    "key_bits": 4,
    "value_bits": 3,
    "fp8_scale": "static",
    "methods": ("snapkv", "knorm"),
    "nd_cell": "full:320:0:agnostic",
    "nd_head": 1,
    "pin": "sink:6,recent:10,heavy:0,scorer:streaming",
    "lab_question": "Who runs the bakery?",
}
# kept at their defaults: the studies page opens only a folder that exists under its root (its own tests
# make one), and its measure is one of that study's; the quantization model, whose logit-noise stand-in a
# real model's page refuses, has a test of its own
AT_DEFAULT = {"study", "st_metric", "qmodel", "merge"}  # merging excludes compressing again: its own test below
# the folded sections that hold settings' widgets, opened so that their widgets are checked too
FOLDED = (ADVANCED, "_solver_open")


def other_value(p: Param):
    """The first value of the parameter's kind other than its default."""
    if p.kind == "bool":
        return not p.default
    if p.kind == "choice":
        return next(c for c in p.choices if c != p.default)
    if p.kind == "list":
        first = tuple(list(p.choices)[:2])
        return first if first != tuple(p.default) else tuple(list(p.choices)[1:3])
    if p.kind == "int":
        return p.default + 1 if p.default + 1 <= p.hi else p.default - 1
    if p.kind == "float":
        return round((p.default + p.hi) / 2, 3)
    raise AssertionError(f"{p.name}: a text parameter needs its value in VALID_TOGETHER")


def every_setting() -> dict:
    """Every parameter (but AT_DEFAULT) at a value other than its default, all valid together."""
    values = {
        name: VALID_TOGETHER[name] if name in VALID_TOGETHER else other_value(PARAMS[name])
        for name in PARAMS
        if name not in AT_DEFAULT
    }
    assert all(v != PARAMS[name].default for name, v in values.items())
    return values


def widgets(at) -> dict:
    """Each keyed widget's shown value by key (multi-choices as tuples)."""
    kinds = (
        "slider",
        "select_slider",
        "selectbox",
        "number_input",
        "checkbox",
        "toggle",
        "radio",
        "text_input",
        "multiselect",
    )
    shown = {}
    for kind in kinds:
        for w in getattr(at, kind):
            if w.key:
                shown[w.key] = tuple(w.value) if isinstance(w.value, list) else w.value
    return shown


def notices(at) -> str:
    return "\n".join(w.value for w in at.warning)


@pytest.mark.parametrize("page", PAGES)
def test_a_link_with_every_setting_restores_each_one_on_every_page(page):
    values = every_setting()
    link = {name: PARAMS[name].encode(v) for name, v in values.items()}
    at = run_app(str(ROOT / PAGES[page]), 300, opened=FOLDED, **link)
    assert not notices(at), notices(at)
    assert [e.value for e in at.error] == []
    store = at.session_state[STORE]
    assert {name: store[name] for name in values} == values
    shown = widgets(at)
    on_screen = {name: shown[name] for name in values if name in shown}
    assert on_screen == {name: values[name] for name in on_screen}
    if page == "explorer":  # the folded sections' widgets were among them
        assert {"scorer", "residual", "solve_kind"} <= set(on_screen)
    assert dict(at.query_params) == link


@pytest.mark.parametrize("page", PAGES)
def test_a_link_that_merges_restores_it_on_every_page(page):
    """Merging (kept out of the link above: it and compressing again exclude each other)."""
    link = {"scorer": "knorm", "sink": "2", "recent": "6", "heavy": "8", "merge": "1"}
    at = run_app(str(ROOT / PAGES[page]), 300, opened=FOLDED, **link)
    assert not notices(at), notices(at)
    assert [e.value for e in at.error] == []
    assert at.session_state[STORE]["merge"] is True
    if page == "explorer":
        assert widgets(at)["merge"] is True
    assert dict(at.query_params) == link


@pytest.mark.parametrize("page", PAGES)
def test_the_logit_noise_model_is_restored_and_a_real_models_page_says_it_cannot_use_it(page):
    link = {"qmodel": "noise", "sigma": "0.5"}
    at = run_app(str(ROOT / PAGES[page]), 300, **link)
    assert not notices(at), notices(at)
    assert at.session_state[STORE]["qmodel"] == "noise" and dict(at.query_params) == link
    refused = [e.value for e in at.error if "logit-noise model only stands in for attention rows" in e.value]
    assert bool(refused) == (page == "model-lab"), [e.value for e in at.error]


BAD = {"int": "abc", "float": "nan", "choice": "zzz", "bool": "maybe", "list": "zzz", "text": "x" * 601}
SAYS = {
    "int": "is not a number",
    "float": "is not a finite number",
    "choice": "is not one of",
    "bool": "is not true/false",
    "list": "ignored zzz",
    "text": "is longer than 600 characters",
}


@pytest.mark.parametrize("page", PAGES)
def test_a_bad_value_of_every_setting_gives_its_notice_and_the_default(page):
    at = run_app(str(ROOT / PAGES[page]), 300, **{name: BAD[p.kind] for name, p in PARAMS.items()})
    said = notices(at)
    for name, p in PARAMS.items():
        quoted = f"`{name}`" if p.kind == "text" else f"`{name}={BAD[p.kind]}`"
        assert f"{quoted} {SAYS[p.kind]}" in said or f"{quoted}: {SAYS[p.kind]}" in said, (name, said)
    store = at.session_state[STORE]
    assert {name: store[name] for name in PARAMS} == {name: p.default for name, p in PARAMS.items()}
    assert dict(at.query_params) == {}


@pytest.mark.parametrize(
    "address, page",
    [
        ("trade-offs", "trade-offs"),
        ("Trade-offs", "trade-offs"),
        ("/Model-lab", "model-lab"),
        ("MODEL_LAB", "model-lab"),
        ("Decode-Timeline", "decode-timeline"),
        ("timeline", "decode-timeline"),
        ("Needle test", "needle-test"),
        ("tradeoffs", "trade-offs"),
        ("explorer", "explorer"),
        ("nosuch", None),
        ("", None),
    ],
)
def test_an_old_or_retyped_address_names_its_page(address, page):
    """Links from before the pages moved to pages/ named a page by its title, and people retype them in any
    case (kvviz.app.router.page_for_address; the browser test opens one)."""
    from kvviz.app.router import page_for_address

    assert page_for_address(address) == page


ISSUE_NUMBER = re.compile(r"#\d{1,2}\b|\bissues? #?\d")  # two digits: "#000" is a colour


@pytest.mark.parametrize("page", PAGES)
def test_no_issue_number_in_what_a_reader_sees(page):
    """Labels, help texts, captions and notes say what a setting or a method does, never which issue brought
    it ("(kvviz before #24)"): every element of every page, its folded sections open, as its protobuf holds it
    (help texts included)."""
    at = run_app(str(ROOT / PAGES[page]), 300, opened=(*FOLDED, "_lesson_open"))

    def texts(node):
        proto = getattr(node, "proto", None)
        if proto is not None and getattr(node, "type", "") not in ("plotly_chart", "bidi_component"):
            yield str(proto)
        for child in node.children.values() if isinstance(getattr(node, "children", None), dict) else ():
            yield from texts(child)

    found = [
        m.group(0) + ": " + t[max(0, m.start() - 60) : m.end() + 20]
        for t in texts(at._tree)
        for m in ISSUE_NUMBER.finditer(t)
    ]
    assert not found, found
