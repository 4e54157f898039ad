"""rlbus's pure-Python stand-in for pycosat (packaging/pycosat/pycosat.py, loaded from the clone whatever pycosat is
installed): every model of a CNF, each once, in pycosat's form, checked against enumerating every assignment.

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym_sat.py
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.common.envs.reasoning_gym import load_stand_in

sat = load_stand_in()


def _all_models(clauses: list[list[int]], num_vars: int) -> set[tuple[int, ...]]:
    out = set()
    for signs in itertools.product((1, -1), repeat=num_vars):
        model = tuple(s * v for s, v in zip(signs, range(1, num_vars + 1)))
        if all(any(lit in model for lit in clause) for clause in clauses):
            out.add(model)
    return out


_literal = st.integers(1, 6).flatmap(lambda v: st.sampled_from([v, -v]))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_literal, min_size=1, max_size=4), max_size=14), st.integers(0, 7))
def test_itersolve_yields_every_model_once(clauses, vars):
    # Repeated literals, x beside -x and variables named in no clause (vars past the largest) included.
    num_vars = max([vars, *(abs(lit) for clause in clauses for lit in clause)])
    models = [tuple(m) for m in sat.itersolve(clauses, vars=vars)]
    assert len(models) == len(set(models))
    assert set(models) == _all_models(clauses, num_vars)
    solved = sat.solve(clauses, vars=vars)
    assert (solved == "UNSAT") if not models else (tuple(solved) in set(models))


def test_pycosat_calling_convention():
    # pycosat's README example: a model names every variable once, with its sign.
    clauses = [[1, -5, 4], [-1, 5, 3, 4], [-3, -4]]
    model = sat.solve(clauses)
    assert sorted(map(abs, model)) == [1, 2, 3, 4, 5] and tuple(model) in _all_models(clauses, 5)
    assert sat.solve([[1], [-1]]) == "UNSAT"
    assert sat.solve([[1], []]) == "UNSAT"  # an empty clause never holds
    assert list(sat.itersolve([])) == [[]]  # no variable: the one empty assignment
    assert len(list(sat.itersolve([], vars=2))) == 4
    assert len(list(sat.itersolve(iter([(1, 2), (-1, -2)]), verbose=0, prop_limit=0))) == 2
    with pytest.raises(ValueError, match="literal of 0"):
        sat.solve([[1, 0]])
