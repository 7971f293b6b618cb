"""Failpoints: let fault injection kill a process at an exact protocol phase (§12, §16).

``dips launch --faults`` arms a failpoint by creating the file ``<dir>/<process>.<point>``
(dir from ``DIPS_FAILPOINTS``, process name from ``DIPS_PROCESS``, both set by the launcher
for its children). When the process reaches that point it records the time in
``<process>.<point>.fired`` and kills itself with SIGKILL: an abrupt crash in the middle of a
push, an update or a pull, which a wall-clock timer could not hit reliably. A
``<process>.link_down`` file emulates a cut network link at application level (used when the
run has no network namespaces to cut for real). Without the environment variables every call
is a no-op costing one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_DIR = os.environ.get("DIPS_FAILPOINTS")
_NAME = os.environ.get("DIPS_PROCESS")


def hit(point: str) -> None:
    """Crash here (SIGKILL) if the failpoint ``point`` is armed for this process."""
    if not _DIR or not _NAME:
        return
    armed = Path(_DIR) / f"{_NAME}.{point}"
    if armed.exists():
        fired = Path(_DIR) / f"{_NAME}.{point}.fired"
        part = fired.with_name(fired.name + ".part")
        part.write_text(str(time.time()))
        os.replace(part, fired)  # whole or absent: the launcher never reads it half written
        armed.unlink(missing_ok=True)
        os.kill(os.getpid(), signal.SIGKILL)


def link_down() -> bool:
    """True while the launcher emulates a cut link for this process."""
    return bool(_DIR and _NAME and (Path(_DIR) / f"{_NAME}.link_down").exists())
