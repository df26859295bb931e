"""The seam between simcloud's REST API (instance records, billing, faults) and what an instance *is*.

The API server calls a backend to bring an instance's machine up and down. `NullBackend` gives paper
instances (for contract tests of the Lambda adapter); the SSH backend gives each instance a sandbox
directory and a real SSH endpoint on 127.0.0.1 whose commands run as real processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Endpoint:
    host: str  # always a loopback address in simcloud
    port: int
    host_key: str | None  # OpenSSH public host key line, e.g. "ssh-ed25519 AAAA..."; pinned to the client
    user: str
    sandbox: str | None = None  # the instance's root directory on this machine


class InstanceBackend(Protocol):
    def start(self, instance_id: str, ssh_public_key: str) -> Endpoint:
        """Bring the instance's machine up; return once it accepts SSH connections (or raise)."""
        ...

    def stop(self, instance_id: str) -> None:
        """Kill every process of the instance and close its SSH endpoint. Idempotent."""
        ...

    def close(self) -> None:
        """Stop every instance (server shutdown)."""
        ...


class NullBackend:
    """Instances with no machine behind them: enough for REST contract tests."""

    def start(self, instance_id: str, ssh_public_key: str) -> Endpoint:
        return Endpoint(host="127.0.0.1", port=22, host_key=None, user="ubuntu")

    def stop(self, instance_id: str) -> None:
        return None

    def close(self) -> None:
        return None
