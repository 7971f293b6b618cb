"""``dips simulate``: a seeded discrete-event simulation of a Di-PS run with modelled costs
(issue 16; seed §5–§8, §12, §13, §16).

The decisions are the real leader's (:mod:`dips.sim.engine`); costs are modelled
(:mod:`dips.sim.costs`, :mod:`dips.sim.network`, :mod:`dips.sim.followers`); the scenario is a
:class:`dips.spec.simulate.SimScenario`. :func:`simulate` runs one and writes ``simulate.json``
(:mod:`dips.sim.report`) and the plots (:mod:`dips.sim.plots`).

Modules: ``costs`` (model size, compute time, ‖Δ‖² draws, memory), ``network`` (fluid flows
over stage links and follower NICs), ``followers`` (the followers as ``run_update`` calls them;
their load), ``member`` (one cluster's state), ``engine`` (the event loop), ``rounds`` (its
update phase and verdicts), ``faults`` (follower and leader faults), ``calibrate`` and
``realrun`` (calibration against the virtual-time engine and a real run), ``report``,
``plots``, ``cli``. Heavy imports happen inside :func:`simulate`, so ``dips --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["simulate"]


def simulate(scenario: Any, out_dir: Path | str | None = None, plots: bool = True) -> dict[str, Any]:
    """Run ``scenario`` (a :class:`dips.spec.simulate.SimScenario`); returns the document of
    ``simulate.json``. With ``out_dir`` (created) writes ``simulate.json`` there and, with
    ``plots``, ``timeline.png`` and ``followers.png``; their names are listed under ``plots``.
    Raises ValueError (or a subclass) if the scenario cannot be simulated."""
    from dips.sim.engine import Simulation
    from dips.sim.report import summarize

    sim = Simulation(scenario).run()
    doc = summarize(sim)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if plots:
            from dips.sim.plots import plot_all

            doc["plots"] = plot_all(sim, doc, out)
        (out / "simulate.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc
