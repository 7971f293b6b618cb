"""``dips init``: create, extend or revoke a run's mutual-TLS PKI (:mod:`dips.wire.pki`).

* ``dips init --config run.yaml --out DIR [--days N]``: a new run CA in ``DIR`` and one
  certificate directory per role: ``leader/``, ``admin/``, ``follower-<i>/`` for each of the
  config's followers, ``cluster-<id>/`` for each of its clusters.
* ``dips init --out DIR --add-cluster ID [--add-cluster ID ...]``: more clusters, issued
  with the existing CA in ``DIR``.
* ``dips init --out DIR --revoke ID [--revoke ID ...]``: revoke clusters (``DIR/revoked.txt``
  and ``DIR/leader/revoked.txt``; copy the latter to the leader host).

A problem is one line on stderr naming it and exit status 2; nothing is overwritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _destination(role: str, ident: str) -> str:
    """Which host a role's directory is copied to."""
    return {"leader": "the leader host", "admin": "the operator",
            "follower": f"follower host {ident}",
            "cluster": f"cluster {ident}'s site"}[role]


def _one_line(exc: BaseException) -> str:
    # Spec errors list one failing field per line; the CLI promises a single line.
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def init(config: Annotated[Path | None, typer.Option(
             "--config", dir_okay=False, metavar="FILE",
             help="YAML run config: its followers and cluster ids get certificates.")] = None,
         out: Annotated[Path, typer.Option(
             "--out", file_okay=False, metavar="DIR",
             help="PKI directory (created; nothing in it is overwritten).")] = ...,
         days: Annotated[int, typer.Option(
             "--days", min=1, metavar="N", help="Certificate lifetime in days.")] = 365,
         add_cluster: Annotated[list[str] | None, typer.Option(
             "--add-cluster", metavar="ID",
             help="Issue this cluster with the existing CA (repeatable).")] = None,
         revoke: Annotated[list[str] | None, typer.Option(
             "--revoke", metavar="ID", help="Revoke this cluster id (repeatable).")] = None,
         ) -> None:
    """Create a run's mutual-TLS PKI: a CA and a certificate for the leader, each follower,
    each cluster and the operator (admin); or add (--add-cluster) or revoke (--revoke)
    clusters."""
    from dips.spec import SpecError, load_config
    from dips.wire import pki

    def show(ident: pki.Identity) -> None:
        typer.echo(f"{ident.name}: {out / ident.name}/ -> {_destination(ident.role, ident.id)}")

    adds, revokes = list(add_cluster or []), list(revoke or [])
    try:
        if adds or revokes:
            for cid in adds + revokes:  # every id checked before anything is written
                pki.Identity.cluster(cid)
            if len(set(adds)) != len(adds):
                raise pki.PkiError(f"--add-cluster repeats an id: {adds}")
            for cid in revokes:
                pki.revoke(out, cid)
                typer.echo(f"revoked cluster {cid}: {out / 'revoked.txt'}, "
                           f"{out / 'leader' / 'revoked.txt'} (copy it to the leader host)")
                if not (out / f"cluster-{cid}").exists():  # a typo would revoke nobody
                    typer.echo(f"note: {out / f'cluster-{cid}'} does not exist; is {cid!r} "
                               "the id you meant?", err=True)
            for cid in adds:
                pki.add_cluster(out, cid, days)
                show(pki.Identity.cluster(cid))
        else:
            if config is None:
                raise pki.PkiError("--config is required (or --add-cluster / --revoke)")
            cfg = load_config(config)
            issued = pki.init_pki(out, cfg.followers, [c.id for c in cfg.clusters], days,
                                   run_name=cfg.name)
            typer.echo(f"CA: {out / 'ca.crt'}, {out / 'ca.key'} (ca.key stays offline with the "
                       "operator; copy it to no host)")
            for ident in issued:
                show(ident)
    except (SpecError, OSError, ValueError) as exc:  # PkiError is a ValueError
        typer.echo(f"dips init: {_one_line(exc)}", err=True)
        raise typer.Exit(2)
