"""Library output goes through `logging` under the `rayhpc` logger; a job decides what is shown.

The job scripts (`rayhpc.cli`) show INFO lines as plain text on stdout. Callbacks that run in
Ray's processes (Ray Train's controller) are told by the job whether to show theirs, since a
logging set-up does not travel to other processes.
"""

from __future__ import annotations

import logging
import sys

_HANDLER_FLAG = "_rayhpc_plain"


def show(level: int = logging.INFO) -> None:
    """Print the platform's log lines at `level` and above as plain lines on stdout (idempotent)."""
    logger = logging.getLogger("rayhpc")
    logger.setLevel(level)
    if not any(getattr(h, _HANDLER_FLAG, False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        setattr(handler, _HANDLER_FLAG, True)
        logger.addHandler(handler)
        logger.propagate = False
