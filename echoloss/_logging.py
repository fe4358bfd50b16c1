"""One logger for the library, and a warn-once helper for rules that degrade instead of failing."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("echoloss")

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(cause: str, message: str) -> bool:
    """Log ``message`` at WARNING the first time ``cause`` is seen in this process.

    Returns True if the message was logged now, False if ``cause`` had already warned.
    """
    with _lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    logger.warning(message)
    return True


def reset_warnings() -> None:
    """Forget which causes have warned (for tests that assert on the log)."""
    with _lock:
        _warned.clear()
