"""The held-out series on the control plane (issue 15): who may report an evaluation, and the
``EvalRecord`` message both ways (the ``ReportEval`` reply and ``StatusReply.last_eval``).

The leader's ``ReportEval`` takes reports only from the operator's identity (``admin``, the
bundle ``dips export`` and ``dips evaluate`` use): a cluster or follower certificate is
refused FORBIDDEN, whatever the request says. The report's fields are checked by
:func:`dips.wire.fields.eval_report`, its version against the leader's by
:func:`dips.algo.evaluation.admit_report`. The client side is :func:`report_eval`.
"""

from __future__ import annotations

import math
from typing import Any

from dips.algo.evaluation import EvalReport
from dips.algo.refusal import Refusal, Refused
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import Identity

__all__ = ["decode", "encode", "report_eval", "require_evaluator"]

#: The identity role that may report held-out evaluations.
EVALUATOR_ROLE = "admin"


def require_evaluator(who: Identity) -> None:
    """Raise Refused(FORBIDDEN) unless ``who`` is the operator's identity (``admin``)."""
    if who.role != EVALUATOR_ROLE:
        raise Refused(Refusal.FORBIDDEN, f"ReportEval: only the operator's identity "
                                         f"({EVALUATOR_ROLE!r}, the bundle of `dips evaluate`) "
                                         f"may report a held-out loss, not {who.name!r}")


def encode(rec: dict[str, Any] | None) -> pb.EvalRecord | None:
    """A leader's ``eval.jsonl`` record as a message (None for None: the field stays unset).
    ``tokens_accepted`` null is sent as -1, ``perplexity`` null as +inf."""
    if rec is None:
        return None
    tokens = rec.get("tokens_accepted")
    ppl = rec.get("perplexity")
    return pb.EvalRecord(time=float(rec["time"]), version=int(rec["version"]),
                         tokens_accepted=-1 if tokens is None else int(tokens),
                         eval_loss=float(rec["eval_loss"]),
                         perplexity=math.inf if ppl is None else float(ppl),
                         eval_tokens=int(rec["eval_tokens"]))


def decode(msg: pb.EvalRecord) -> dict[str, Any]:
    """The record of a message (the inverse of :func:`encode`): JSON-safe, ``tokens_accepted``
    and ``perplexity`` None where unknown or infinite."""
    return {"time": msg.time, "version": msg.version,
            "tokens_accepted": msg.tokens_accepted if msg.tokens_accepted >= 0 else None,
            "eval_loss": msg.eval_loss,
            "perplexity": msg.perplexity if math.isfinite(msg.perplexity) else None,
            "eval_tokens": msg.eval_tokens}


def last_eval(reply: pb.StatusReply) -> dict[str, Any] | None:
    """The last evaluation a ``GetStatus`` reply carries (:func:`decode`), or None."""
    return decode(reply.last_eval) if reply.HasField("last_eval") else None


def report_eval(client: Any, report: EvalReport, timeout_s: float) -> dict[str, Any]:
    """Send ``report`` to the leader through ``client`` (a :class:`dips.wire.control.Client`
    of the Leader service held by the operator's identity); returns the record it wrote.
    Raises grpc.RpcError: refused (FORBIDDEN, INVALID_ARGUMENT naming the field and value;
    :func:`dips.wire.control.refusal_of` gives the code) or unreachable within ``timeout_s``
    seconds."""
    reply = client.ReportEval(pb.EvalReport(version=report.version, eval_loss=report.eval_loss,
                                            eval_tokens=report.eval_tokens), timeout=timeout_s)
    return decode(reply)
