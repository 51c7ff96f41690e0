"""Errors of the agent's API requests (importable without the Kubernetes client, which is an extra)."""

from __future__ import annotations


class KubeError(Exception):
    """A failed API request: `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ResourceExpired(KubeError):
    """A watch's resourceVersion is too old (410 Gone): list again."""
