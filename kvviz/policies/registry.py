"""The scorer registry: kvviz's built-in policies by name, and plug-ins found lazily.

`get_policy(name)` returns the policy instance; a name kvviz does not know makes it load the
installed plug-ins once (entry-point group `kvviz.policies`) before giving up.

Plug-ins (docs/plugins.md). A plug-in is a `kvviz.policies.Policy` subclass (set `name`, `description`, implement
`score(ctx) -> (kv_heads, positions)` or `(positions,)`), or a plain function
`score(ctx) -> array` (its name is the scorer's name, its docstring's first line the
description). kvviz finds plug-ins in two ways:

    installed   an entry point in the group `kvviz.policies` of any installed package:
                    [project.entry-points."kvviz.policies"]
                    mine = "my_package.module:MyPolicy"
                loaded once, the first time kvviz needs a scorer it does not know, and by
                the app at start-up (its scorer list shows them with their description)
    a file      the command line's `--policy path/to/file.py:ClassName` (or :function)

Code is only ever run from an installed package or a file named on the command line:
the app never accepts code, paths or module names through the browser.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from pathlib import Path

from kvviz.policies.base import Policy
from kvviz.spec import PLUGIN_SCORERS, SCORERS, STREAMING_SCORERS, SpecError

# the modules of this package that are not scorers
_NOT_SCORERS = frozenset({"base", "reads", "select", "allocation", "registry"})


def _builtins() -> dict[str, Policy]:
    """Every Policy subclass with a name defined in a module of this package: a new scorer is a new file,
    found here (menu order: each class's `order`)."""
    import kvviz.policies as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name in _NOT_SCORERS:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, Policy) and cls.__module__ == module.__name__ and cls.name
        ]
    return {cls.name: cls() for cls in sorted(found, key=lambda c: (c.order, c.name))}


POLICIES: dict[str, Policy] = _builtins()
SCORERS[:] = list(POLICIES)
STREAMING_SCORERS[:] = [n for n, p in POLICIES.items() if p.streaming]


def featured(keep=lambda policy: True) -> tuple[str, ...]:
    """The scorers a comparison opens on (`Policy.featured`; the built-ins, and plug-ins registered by then), in
    their rank, those `keep` accepts."""
    ranked = sorted((p.featured, n) for n, p in POLICIES.items() if p.featured and keep(p))
    return tuple(n for _, n in ranked)


def followed_while_decoding() -> tuple[str, ...]:
    """What the decode timeline opens on: the featured scorers whose kept set changes at every decode step
    (H2O, TOVA by their history, StreamingLLM's window) and the bound that re-selects at each step, in the
    menu's order (history-based eviction first: the page's story)."""
    changing = featured(lambda p: p.streaming or p.window_only or p.bound)
    return tuple(sorted(changing, key=lambda n: POLICIES[n].order))


def is_bound(name: str) -> bool:
    """Whether `name` (a scorer, or any other method name a chart shows) is the bound, not a method."""
    return name in POLICIES and POLICIES[name].bound


# the reference bound's scorer name (the oracle)
BOUND = next(n for n, p in POLICIES.items() if p.bound)


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        load_entry_points()
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(POLICIES)}") from None


GROUP = "kvviz.policies"
_loaded_entry_points = False
ERRORS: list[str] = []  # entry points that failed to load, one line each (the app shows them)


class PluginError(SpecError):
    """A plug-in that cannot be used; the message says why."""


def _wrap_function(fn, name: str):
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    cls = type(
        f"FunctionPolicy_{name}",
        (Policy,),
        {
            "name": name,
            "description": doc[0] if doc else f"plug-in function {fn.__module__}.{fn.__qualname__}",
            "score": lambda self, ctx: fn(ctx),
        },
    )
    return cls()


def as_policy(obj, name: str | None = None):
    """A Policy instance from a Policy subclass, an instance, or a score(ctx) function."""
    if isinstance(obj, type) and issubclass(obj, Policy):
        policy = obj()
    elif isinstance(obj, Policy):
        policy = obj
    elif callable(obj):
        policy = _wrap_function(obj, name or obj.__name__)
    else:
        raise PluginError(f"{obj!r} is not a kvviz Policy subclass or a score(ctx) function")
    if not getattr(policy, "name", ""):
        if name is None:
            raise PluginError(f"plug-in {type(policy).__name__} has no `name`")
        policy.name = name
    return policy


def register(obj, name: str | None = None):
    """Add a plug-in to the scorer registry; returns its Policy instance."""
    policy = as_policy(obj, name)
    n = policy.name
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", n):
        raise PluginError(f"plug-in scorer name {n!r} must be a short identifier (letters, digits, _ . -)")
    if n in SCORERS:
        raise PluginError(f"plug-in scorer {n!r} would replace kvviz's built-in {n!r}; give it another name")
    if type(policy).score is Policy.score and not policy.needs_query:
        raise PluginError(f"plug-in {n!r} does not implement score(ctx)")
    if not getattr(policy, "description", ""):
        policy.description = f"plug-in {type(policy).__module__}.{type(policy).__qualname__}"
    POLICIES[n] = policy
    if n not in PLUGIN_SCORERS:
        PLUGIN_SCORERS.append(n)
    return policy


def load_entry_points(force: bool = False) -> list[str]:
    """Register every installed plug-in of the group `kvviz.policies`; returns their names.
    A plug-in that fails to load is skipped with a one-line reason in ERRORS."""
    global _loaded_entry_points
    if _loaded_entry_points and not force:
        return list(PLUGIN_SCORERS)
    _loaded_entry_points = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP):
        try:
            register(ep.load(), ep.name)
        except Exception as exc:  # a broken plug-in must not take kvviz down
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            msg = f"plug-in {ep.name!r} ({ep.value}) could not be loaded: {reason}"
            if msg not in ERRORS:
                ERRORS.append(msg)
    return list(PLUGIN_SCORERS)


def load_file(target: str):
    """`path/to/file.py:Name` -> the registered Policy (the command line's --policy)."""
    path, sep, attr = target.rpartition(":")
    if not sep or not path or not attr:
        raise PluginError(f"--policy takes path/to/file.py:ClassName, got {target!r}")
    f = Path(path)
    if f.suffix != ".py" or not f.is_file():
        raise PluginError(f"--policy: no Python file {f}")
    mod_name = "kvviz_plugin_" + re.sub(r"\W", "_", str(f.resolve()))
    spec = importlib.util.spec_from_file_location(mod_name, f)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise PluginError(f"--policy: {f} failed to import: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise PluginError(f"--policy: {f} has no {attr!r}")
    return register(getattr(module, attr))
