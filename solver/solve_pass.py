"""The planner's solve and choose passes, run once per layout space: shrink, prune and solve
every variant (CP-SAT, LPs ahead in threads), build and simulate each plan, keep the fastest."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from ..ir.errors import ArgumentError
from . import shrinking
from .build import SEED_PLAN, build_plan, simulated, solver_stats
from .costs import Space
from .ilp import Solution, prepare, proven_within_gap, relax, solve
from .memory import infeasible_error
from .planner_state import NoPlanInTime, PlanningState
from .problem import Problem
from .space_passes import SpacePass, register_planner_pass

LP_THREADS = 2
"""Threads for the variants' LPs: GLOP releases the GIL, so one variant's LP runs while the
next is shrunk and pruned, and two LPs run at once (measured on the README's JAX GPT: the two
LPs 1.9-2.5 s one after the other, 1.6-1.9 s side by side, same solutions)."""


@register_planner_pass
class Solve(SpacePass):
    """Shrink, prune and solve each variant (CP-SAT); build and simulate its plan.

    Variants are (objective, follower merging) pairs (``ilp.solve``); an axis-search step
    (``quick``) keeps only its choice."""

    name = "solve"

    def apply(self, state: PlanningState) -> None:
        problem = state.need("problem", self.name, "price")
        objectives = state.objectives if state.objectives is not None else [problem]
        last = len(state.merges) - 1  # shrinking changes a problem: earlier merges take copies
        variants = [
            (p if n == last or callable(p) else p.copy(), m)
            for n, m in enumerate(state.merges) for p in objectives
        ]  # fmt: skip
        if state.shrunk and variants[0] == (problem, True):  # the same shrink: reuse it
            variants[0] = (state.shrunk[0], True)  # (70B: 2.7 s)
        chosen: list[list[int]] = []
        if state.step is not None:  # the axis-search step's solve stands as the first variant
            state.plans.append(_built(state, *state.step))
            chosen.append(state.step[1].choice)
            variants = variants[1:]
        left = state.share * state.options.time_limit  # CP-SAT deterministic time (ilp.py)
        with ThreadPoolExecutor(max_workers=LP_THREADS) as pool:
            ahead = _prepare_ahead(state, variants, pool, left)
            for index, ((_, merge), made) in enumerate(zip(variants, ahead, strict=True)):
                budget = max(1.0, left) / (len(variants) - index)  # the limit covers them all
                solution = _solve_one(state, made, budget)
                left = max(0.0, left - solution.seconds_of_budget)  # what one leaves, the next
                if _take(state, merge, made[0], solution, chosen) == "stop":
                    break


@register_planner_pass
class Choose(SpacePass):
    """Keep the plan the two-stream simulator finds fastest (ties: the plain objective's)."""

    name = "choose"

    def apply(self, state: PlanningState) -> None:
        if state.result is not None:  # an axis-search step: its choice only
            return
        if not state.plans:
            raise ArgumentError(
                "the pipeline built no plan for this space: put 'solve' before 'choose' "
                "(the default: shardplan plan --print-passes)"
            )
        state.result = min(state.plans, key=lambda p: p[0].step_time)


def _solve_one(state: PlanningState, made: tuple, budget: float) -> Solution:
    """CP-SAT on one prepared variant (``ilp.solve``)."""
    o, (candidate, prepared, relaxation) = state.options, made
    capped = state.work if state.share < 1 else None  # a step cut short stays deterministic
    lp_seed = state.seeded and state.binds
    micro = o.micro_sizes and o.batch_split_limit is not None
    # a pipeline cap enumerated by micro-batch sizes solves memory-bound only from its LP seed
    # (``ilp.solve``'s ``seed_needed``); without one the pipeline solves the cap again in the
    # whole-batch space (``pipeline._sized``)
    return state.clock("solve", solve, candidate, budget, state.warm, memory=state.memory,
                       work_limit=capped, prepared=prepared, relaxation=relaxation,
                       lp_seed=lp_seed, search=o.memory_search,
                       seed_needed=micro)  # fmt: skip


def _take(state: PlanningState, merge: bool, candidate: Problem, solution: Solution,
          chosen: list) -> str:  # fmt: skip
    """Build the variant's plan into ``state.plans``: "stop" when no other variant is needed
    (a quick step's choice, or a seeded memory-bound plan proven close), else "next"."""
    if not solution.choice and state.plans and not merge:
        return "next"  # the exact variant is extra: a merged plan stands
    if not solution.choice:
        if solution.status == "INFEASIBLE":  # memory hook: say what the minimum is
            raise infeasible_error(state.memory, candidate, state.limit)
        raise NoPlanInTime(
            f"the solver found no plan ({solution.status}) within "
            f"{state.options.time_limit:.0f} s; raise time_limit or the memory limit"
        )
    if state.quick:
        state.space.solved = (merge, candidate, solution, state.memory)  # type: ignore[union-attr]
        state.result = (None, solution.choice, solution.objective)
        return "stop"
    if solution.choice in chosen:
        return "next"  # the same layouts: the plan is already built and simulated
    chosen.append(solution.choice)
    state.plans.append(_built(state, candidate, solution, state.memory))
    proven = (
        state.seeded
        and state.binds
        and solution.status != "OPTIMAL"
        and proven_within_gap(solution, state.memory)
    )
    # the limit shaped the plan (a search, not the LP) and it is proven close: the other
    # objective is not solved (an OPTIMAL one's is cheap: the README demo's 16-layer Llama,
    # 20 of 74 GiB, keeps its 0.1% better plan)
    return "stop" if proven else "next"


def _prepare_ahead(state: PlanningState, variants: list, pool, left: float):  # type: ignore[no-untyped-def]
    """Per variant, in order: shrink, prune and eliminate it here, and hand its LP to ``pool``
    at once. Every step is what ``solve`` would do itself, in the same order; only the LPs run
    concurrently, so the plans are the same. Seeded memory-bound solves prepare each variant
    only when the loop reaches it, since one proven within ``ilp.MEMORY_GAP`` ends the loop
    (70B: 2.7 s of shrinking, 1.8 s of pruning and an LP). Problems already shrunk (the seed's
    copy of the plain one) are not shrunk again."""
    shrunk = frozenset(map(id, state.shrunk))
    if state.seeded and state.binds:
        return (_prepare_one(state, c, m, pool, left, shrunk) for c, m in variants)
    return [_prepare_one(state, c, m, pool, left, shrunk) for c, m in variants]


def _prepare_one(state: PlanningState, candidate, merge: bool, pool, left: float, shrunk):  # type: ignore[no-untyped-def]
    """(the variant's problem, prepared, its LP's future); a callable ``candidate`` makes it."""
    if callable(candidate):
        candidate = candidate()
    o, clock = state.options, state.clock
    if id(candidate) not in shrunk:
        clock("shrink", shrinking.shrink, candidate, state.space, o.share_layers, merge)
    prepared = clock("prune", prepare, candidate, state.warm, state.memory)
    return candidate, prepared, pool.submit(relax, prepared, max(1.0, left))


def _built(state: PlanningState, problem: Problem, solution: Solution, memory):  # type: ignore[no-untyped-def]
    """(the simulated plan, its choice, its solver objective)."""
    space: Space = state.space  # type: ignore[assignment]
    seed = space.tables.get(SEED_PLAN)
    if (
        seed is not None
        and memory is not None
        and seed[0] == solution.choice
        and seed[1] == memory.decisions
    ):  # the seed's own layouts and recomputation (Llama-3-8B f32): built and simulated once
        plan = dataclasses.replace(seed[2], solver=solver_stats(solution, problem))
        return plan, solution.choice, solution.objective
    plan = state.clock("build", build_plan, space, state.cluster, solution, problem, memory)
    return state.clock("simulate", simulated, plan), solution.choice, solution.objective
