"""What ``dips launch`` checks of its clusters before it starts any process (issue 14, review 32).

A cluster that cannot start is found here, by field and value, not by its ranks once they
run: there a torchrun job exits 1 whatever its ranks' reason (``dips.torchrun`` makes that 2
only when every failed rank exited 2), and the launcher restarted it every few seconds for
the whole run. Checked, for each ``clusters`` entry:

* ``parallel`` given with ``ranks: 1``: the cluster would run as one process, which ignores
  ``parallel`` (at a real site the operator's torchrun sets the ranks; in ``dips launch``
  ``ranks`` does);
* ``parallel: pipeline`` with more ranks than decoder blocks (the rule of
  :func:`dips.train.pipeline.stage_blocks`, on the prepared model's layers);
* ``device``: usable on this host, for each local rank
  (:func:`dips.train.trainer.resolve_device`: CUDA available, ``cuda:LOCAL_RANK`` visible).
"""

from __future__ import annotations

from dips.spec import RunConfig, SpecError


def check_clusters(cfg: RunConfig, layer_keys: list[str]) -> None:
    """Raise :class:`dips.spec.SpecError` naming ``clusters[i].FIELD``, its value and the
    fix for the first entry of ``cfg.clusters`` that cannot start on this host.

    ``layer_keys``: the prepared model's layer keys in model order (``RunSpec.layers``:
    ``embed``, ``layers.0`` …, ``head``)."""
    from dips.train.pipeline import stage_blocks
    from dips.train.trainer import resolve_device

    for i, c in enumerate(cfg.clusters):
        where = f"clusters[{i}] (id {c.id!r})"
        if c.ranks == 1 and "parallel" in c.model_fields_set:
            raise SpecError(f"{where}: parallel = {c.parallel!r} with ranks = 1: dips launch "
                            "runs this cluster as one process, which does not use parallel; "
                            "set ranks (>= 2) to run it as a torchrun job, or remove parallel")
        if c.parallel == "pipeline" and c.ranks > 1:
            try:
                stage_blocks(layer_keys, c.ranks)
            except ValueError as exc:
                raise SpecError(f"{where}: ranks = {c.ranks}: {exc}") from None
        for local in range(c.ranks) if c.device is not None else ():
            try:
                resolve_device(c.device, local if c.ranks > 1 else None)
            except ValueError as exc:
                raise SpecError(f"{where}: {exc}") from None
