"""Times as the Kubernetes API writes them: pure."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(timestamp: float) -> str:
    """A Unix time as RFC 3339 in UTC, to the second (metav1.Time's form)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
