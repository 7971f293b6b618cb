"""The global model's held-out points of a run, and what that series is, in words.

Points (:func:`heldout_points`): ``eval_loss_initial`` (at 0 s, 0 tokens), every evaluation
record (the leader's ``eval.jsonl`` of ``dips evaluate``: at its ``time`` and
``tokens_accepted``), and ``eval_loss_final`` (at ``train_time_s``, ``tokens_accepted``) of
``summary.json`` (without the ``train_start`` file to count ``train_time_s`` from: at the last
outer step); the summary's points are left out where the series has their version (0,
``final_version``).

The evaluator evaluates the version the followers serve when one is due (every N-th, and the
final one; :mod:`dips.algo.evaluation`): followers serve only their current version, so a due
version it could not pull in time (a follower or the leader down, the run moved on during
the pull) is skipped for the newest, and one started late begins at the version then
current. The series is therefore not always one point per N versions (review 33 m6: 25
instead of 24 after a leader outage; no version 0 from an evaluator started late), and
:func:`heldout_note` says under the figure which versions it holds and which due ones it
lacks.
"""

from __future__ import annotations

from dips.bench.runreport.files import RunFiles, num

__all__ = ["every_of", "heldout_note", "heldout_points"]

_LISTED = 8  # versions named in the note at most (then "…")


def heldout_points(run: RunFiles) -> list[tuple[float | None, float | None, float]]:
    """(seconds since the start, tokens accepted, held-out loss) of every evaluation known:
    the initial model's (``summary.json``'s ``eval_loss_initial``, else ``run.json``'s, as
    the key figures take it), the evaluations, the summary's final one (the initial or final
    point is left out when an evaluation record is of the same version: the evaluator's
    series already has it)."""
    s = run.summary or {}
    pts: list[tuple[float | None, float | None, float]] = []
    versions = {r.get("version") for r in run.evals}
    initial = _initial(run)
    if initial is not None and 0 not in versions:
        pts.append((0.0, 0.0, initial))
    for rec in run.evals:
        t = num(rec, "time")
        tok = num(rec, "tokens_accepted")
        pts.append((None if t is None else run.rel(t),
                    tok if tok is not None else num(rec, "tokens"), float(rec["eval_loss"])))
    final = s.get("final_version")
    if (v := num(s, "eval_loss_final")) is not None and (final is None or final not in versions):
        ends = [run.rel(t) for r in run.outer_steps if (t := num(r, "time")) is not None]
        t_end = num(s, "train_time_s") if run.train_start is not None or not ends else max(ends)
        pts.append((t_end, num(s, "tokens_accepted"), v))
    return pts


def _initial(run: RunFiles) -> float | None:
    initial = num(run.summary or {}, "eval_loss_initial")
    if initial is None:  # a run in progress, or without the launcher's files (review 28 #5)
        initial = num(run.run_spec or {}, "eval_loss_initial")
    return initial


def every_of(run: RunFiles) -> int | None:
    """The evaluator's N (``run.json``'s ``config.evaluate.every``), or None if not known."""
    config = (run.run_spec or {}).get("config")
    ev = config.get("evaluate") if isinstance(config, dict) else None
    n = num(ev, "every") if isinstance(ev, dict) else None
    return int(n) if n is not None and n >= 1 else None


def _listed(versions: list[int]) -> str:
    shown = ", ".join(map(str, versions[:_LISTED]))
    return shown + (f", … ({len(versions)} in all)" if len(versions) > _LISTED else "")


def heldout_note(run: RunFiles) -> str | None:
    """What the held-out series of ``run`` holds (module docstring), or None without
    evaluation records."""
    versions = sorted({int(v) for r in run.evals if (v := num(r, "version")) is not None})
    if not versions:
        return None
    every = every_of(run)
    final = num(run.summary or {}, "final_version")
    text = (f"held-out series: {len(versions)} evaluations by dips evaluate (eval.jsonl) of "
            f"versions {versions[0]} to {versions[-1]}")
    if every is None:
        return text
    text += (f": each multiple of {every} the evaluator could pull, and the final version (it "
             "evaluates the version the followers serve when one is due, so a due version it "
             "could not pull in time is skipped for the newest)")
    first = versions[0]
    off = [v for v in versions[1:] if v % every and v != final]
    skipped = [m for m in range(-(-first // every) * every, versions[-1] + 1, every)
               if m not in versions]
    if skipped:
        text += f"; due but not evaluated: {_listed(skipped)}"
    if off:
        text += f"; evaluated instead, off the multiples of {every}: {_listed(off)}"
    if final is not None and int(final) in versions and final % every:
        text += f"; {int(final)} is the final version"
    if first != 0:
        text += f"; the evaluator's first look was at version {first}"
        if _initial(run) is not None:
            text += " (the point at 0 s is the initial model's eval_loss_initial)"
    return text
