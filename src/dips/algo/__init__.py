"""Pure math and decisions of Di-PS: penalty, aggregation, clipping, outer optimizer, grace
window, schedule and layer ownership (§6, §7, §8, §10 of the seed).

Imports only torch and the standard library; no sockets, threads, sleeps, env reads or wall
clock (time is passed in as float seconds).
"""

from dips.algo.aggregate import clip_factor, squared_norm, token_weights, weighted_mean
from dips.algo.outer import OuterConfig, nesterov_step, pseudo_gradient
from dips.algo.partition import min_max_part_sum, partition_contiguous
from dips.algo.penalty import PenaltyConfig, PenaltyState, Verdict, decide
from dips.algo.schedule import Transfer, greedy_schedule
from dips.algo.window import FixedGraceWindow

__all__ = [
    "FixedGraceWindow",
    "OuterConfig",
    "PenaltyConfig",
    "PenaltyState",
    "Transfer",
    "Verdict",
    "clip_factor",
    "decide",
    "greedy_schedule",
    "min_max_part_sum",
    "nesterov_step",
    "partition_contiguous",
    "pseudo_gradient",
    "squared_norm",
    "token_weights",
    "weighted_mean",
]
