"""Shared test helpers for studies: a one-layer synthetic study built from its grid, and its rows."""


def one_layer_study(name: str, *, context: int, steps: int, grid: str):
    """A study named `name` over a synthetic source of `context` tokens and `steps` later queries, in
    one layer of 2 query heads over 1 KV head (head_dim 64, seed 0): small enough for any test.
    `grid` is the body of its [grid] table, one `axis = [values]` a line."""
    from kvviz.analysis.study import parse_study

    return parse_study(f"""
        name = "{name}"
        [source]
        kind = "synthetic"
        context = {context}
        steps = {steps}
        layers = 1
        q_heads = 2
        kv_heads = 1
        head_dim = 64
        seeds = [0]
        [grid]
        {grid}
    """)


def study_rows(study, folder):
    """Run `study` into `folder`; returns its rows (one a cell)."""
    from kvviz.analysis.study import StudyDir, run_study

    run_study(study, folder)
    return StudyDir(folder).rows()


def check_one_axis(folder, name: str, *, context: int, steps: int, scorer: str, budget: float, axis: str, values):
    """Run into `folder` a one_layer_study of `scorer` at `budget` over the integer `values` of the study axis
    `axis`: its rows have each value, one a row, and their mass retained differs (the axis reached the
    cache). Returns the study."""
    grid = f'scorers = ["{scorer}"]\nbudgets = [{budget}]\n{axis} = {list(values)}'
    study = one_layer_study(name, context=context, steps=steps, grid=grid)
    rows = study_rows(study, folder).sort_values(axis)
    assert rows[axis].tolist() == list(values)
    assert rows["mass_retained"].nunique() == len(values)
    return study
