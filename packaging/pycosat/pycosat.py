"""rlbus's pure-Python stand-in for pycosat 0.6.6: the two functions reasoning-gym calls, `itersolve` and `solve`,
with pycosat's calling convention: clauses as sequences of non-zero ints (DIMACS literals), a model as the list
[±1, ±2, ..., ±n] of every variable, "UNSAT" when there is none. No C extension.

Every release of reasoning-gym pins pycosat==0.6.6, a C extension with no binary wheel on PyPI, and imports it with
every task; only its zebra_puzzles generator solves anything (whether a puzzle's clues leave exactly one solution).
rlbus's `reasoning-gym` extra installs this file as the distribution `pycosat` 0.6.6 (packaging/pycosat/
pyproject.toml), which satisfies that pin without a compiler; where no pycosat is installed at all (reasoning-gym
installed with --no-deps), common/envs/reasoning_gym.py loads this file in its place while reasoning-gym imports.
Only the number of models and their contents matter to reasoning-gym, not their order, so the puzzles are the ones
pycosat makes. The search is DPLL: unit propagation, then a branch on the variable in the most open clauses, both
values in turn, so that every model is enumerated once.

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym_sat.py
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

__version__ = "0.6.6"  # the pycosat release it stands for


def itersolve(clauses: Iterable[Sequence[int]], vars: int = 0, **_ignored: Any) -> Iterator[list[int]]:
    """Every assignment of variables 1..n that satisfies all `clauses`, each once (n: `vars` or the largest
    variable named). pycosat's `verbose` and `prop_limit` are accepted and ignored."""
    # A literal twice in a clause, or x beside -x, needs no care: the search stays exact, only less quick.
    cnf = [tuple(clause) for clause in clauses]
    literals = set(chain.from_iterable(cnf))
    if 0 in literals:
        raise ValueError("a literal of 0 in a clause (variables are numbered from 1)")
    if not all(cnf):
        return  # an empty clause never holds
    num_vars = max(vars, max(map(abs, literals), default=0))
    yield from _Search(cnf, num_vars).models()


def solve(clauses: Iterable[Sequence[int]], vars: int = 0, **_ignored: Any) -> list[int] | str:
    """One model of `clauses`, or "UNSAT"."""
    return next(itersolve(clauses, vars), "UNSAT")


class _Search:
    """Depth-first search over partial assignments. `truth[lit]` is 1 once literal `lit` holds, -1 once it is
    false, 0 while its variable is open; a negative literal indexes from the end of the list, where it meets no
    positive one (the list has 2n+1 entries)."""

    def __init__(self, cnf: list[tuple[int, ...]], num_vars: int) -> None:
        self.cnf = cnf
        self.num_vars = num_vars
        self.truth = [0] * (2 * num_vars + 1)
        self.trail: list[int] = []  # the literals made true, in order: undone back to a mark on backtracking
        # literal -> the clauses it occurs in, looked at when it turns false
        self.occurs: list[list[tuple[int, ...]]] = [[] for _ in range(2 * num_vars + 1)]
        for clause in cnf:
            for lit in clause:
                self.occurs[lit].append(clause)

    def _set(self, lit: int) -> None:
        self.truth[lit], self.truth[-lit] = 1, -1
        self.trail.append(lit)

    def _undo(self, mark: int) -> None:
        truth, trail = self.truth, self.trail
        while len(trail) > mark:
            lit = trail.pop()
            truth[lit] = truth[-lit] = 0

    def _propagate(self, start: int) -> bool:
        """Set every literal that a clause left with one open literal forces, from trail[start] on; False on a
        clause with none left."""
        truth, trail, occurs = self.truth, self.trail, self.occurs
        i = start
        while i < len(trail):
            for clause in occurs[-trail[i]]:
                open_lit = 0
                for lit in clause:
                    t = truth[lit]
                    if t > 0:
                        break
                    if t == 0:
                        if open_lit:
                            break  # two open: nothing forced yet
                        open_lit = lit
                else:
                    if not open_lit:
                        return False
                    self._set(open_lit)
            i += 1
        return True

    def _branch_lit(self) -> int:
        """An open literal of the shortest clause not yet satisfied; when every clause is, the first open variable
        (0 when none is left)."""
        truth, best, best_open = self.truth, 0, 1 << 30
        for clause in self.cnf:
            num_open, first = 0, 0
            for lit in clause:
                t = truth[lit]
                if t > 0:
                    break
                if t == 0:
                    num_open += 1
                    first = first or lit
            else:
                if num_open < best_open:
                    best, best_open = first, num_open
                    if num_open == 2:
                        break
        if best:
            return best
        return next((v for v in range(1, self.num_vars + 1) if truth[v] == 0), 0)

    def models(self) -> Iterator[list[int]]:
        for clause in self.cnf:
            if len(clause) == 1:
                if self.truth[clause[0]] < 0:
                    return
                if self.truth[clause[0]] == 0:
                    self._set(clause[0])
        if self._propagate(0):
            yield from self._search()

    def _search(self) -> Iterator[list[int]]:
        branch = self._branch_lit()
        if branch == 0:  # every variable set and no clause false: a model
            yield [v if self.truth[v] > 0 else -v for v in range(1, self.num_vars + 1)]
            return
        for lit in (branch, -branch):
            mark = len(self.trail)
            self._set(lit)
            if self._propagate(mark):
                yield from self._search()
            self._undo(mark)
