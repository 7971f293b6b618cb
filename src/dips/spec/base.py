"""The base of every configuration model, and reading one from a YAML file.

:mod:`dips.spec` is the bottom layer of the package: configuration only.  It imports
pydantic, PyYAML and the standard library, nothing else of dips (no torch), so that any
process — the leader, the launcher's command-line parsing, a test — can validate a run's
settings without paying for the training stack.

Conventions of every model in :mod:`dips.spec`:

* one model per concept (model, data, inner, outer, penalty, grace, membership, link,
  cluster, …), used everywhere the concept appears — never a second copy of a field;
* unknown keys are refused (``extra="forbid"``): a typo or a key of an older layout must not
  fall back silently to a default;
* every field has a ``Field(description=...)``; its unit is in the name (``_s`` seconds,
  ``_bps`` bits per second, ``_bytes``, ``_tokens``) or in the description;
* validation errors are :class:`SpecError` (a ValueError) when read through
  :func:`load_yaml`: one compact message naming the file, each failing field path and value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["SpecError", "Strict", "format_validation_error", "load_yaml", "validate"]

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base of every configuration model: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


class SpecError(ValueError):
    """A configuration file or document that cannot be used; the message is one line per
    problem (usually one line in all), naming the file, the field path and the value."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(exc: ValidationError, source: str | None = None) -> str:
    """A compact rendering of a pydantic ``ValidationError``.

    One line per failing field: ``<source>: <field.path> = <value>: <message>``, where the
    path joins pydantic's location with dots (list indices included: ``clusters.0.link.bps``)
    and ``<value>`` is the offending input (shortened).  ``source`` is the file name or None.
    """
    lines = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(p) for p in err.get("loc", ())) or "<document>"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        value = err.get("input")
        if err.get("type") == "extra_forbidden":
            head = f"{path}: unknown key (not a field of this section)"
        elif err.get("type") == "missing":
            head = f"{path}: field required"
        elif isinstance(value, (dict, list)) and err.get("type") == "value_error":
            head = f"{path}: {msg}"  # a check across a whole section: its message names fields
        else:
            head = f"{path} = {_short(value)}: {msg}"
        lines.append(f"{source}: {head}" if source else head)
    return "\n".join(lines) if lines else str(exc)


def validate(model_cls: type[M], data: Any, source: str | None = None) -> M:
    """``model_cls.model_validate(data)``, a ``ValidationError`` re-raised as :class:`SpecError`
    with :func:`format_validation_error`'s message (``source`` names where ``data`` came from)."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, source)) from None


def load_yaml(path: Path | str, model_cls: type[M]) -> M:
    """Read the YAML file ``path`` and validate it as ``model_cls``.

    An empty file is an empty mapping (every field at its default).

    Raises:
        FileNotFoundError / OSError: the file cannot be read.
        SpecError: a YAML syntax error, as ONE line naming the file and the 1-based
            line:column (``configs/x.yaml:12:3: mapping values are not allowed here``); a
            document that is not a mapping; or the fields that fail validation, each with its
            path and value (:func:`format_validation_error`).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        raise SpecError(f"{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: {' '.join(str(exc).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a YAML mapping of {model_cls.__name__} fields, "
                        f"got a {type(data).__name__}")
    return validate(model_cls, data, str(path))
