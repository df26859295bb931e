"""Build the configured providers. The only place that knows which adapter serves which config section."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.config import Config
from providers.base import AuthFailed, EventSink, Provider, RetryPolicy

PROVIDER_NAMES = ("sim", "lambda", "ec2")


@dataclass(frozen=True)
class ProviderSlot:
    """A configured provider: the adapter when it could be built, or why it could not."""

    name: str
    enabled: bool
    credential: str  # what holds the credential: an env var's *name*, a key file's path, or the AWS chain
    credential_present: bool
    provider: Provider | None
    problem: str | None = None


def _aws_credentials_problem(profile: str | None) -> str | None:
    """Why the AWS credential chain gives nothing usable, or None when it gives credentials."""
    import boto3
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    try:
        found = boto3.Session(profile_name=profile).get_credentials() is not None
    except ProfileNotFound as exc:
        # Named by [providers.ec2] profile or by AWS_PROFILE: say which, or the user looks for missing keys.
        named = f"[providers.ec2] profile {profile!r}" if profile else f"AWS_PROFILE {exc.kwargs.get('profile')!r}"
        return f"{named} is not a profile in ~/.aws/config or ~/.aws/credentials"
    except BotoCoreError as exc:  # a profile that is there but broken (e.g. a credential_process that fails)
        return f"the AWS credential chain failed: {type(exc).__name__}"
    if not found:
        return "no AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
    return None


def build(cfg: Config, *, orchestrator_id: str | None = None, sink: EventSink | None = None,
          environ: Mapping[str, str] = os.environ, tuning: Mapping[str, Mapping[str, Any]] | None = None
          ) -> dict[str, ProviderSlot]:
    """Every provider section, enabled or not; adapters only for enabled ones with credentials. `orchestrator_id`:
    the installation's owner tag (`App.orchestrator_id`), else the config's, else "burstctl"."""
    owner = orchestrator_id or cfg.orchestrator_id or "burstctl"
    from providers import lambda_cloud

    # simcloud is a local process: Lambda's client-side pacing (1 req/s, 1 launch/12 s) would only slow it down.
    # The daemon must never block long on a cloud call: tighter timeouts and retries than the adapters' defaults.
    quick = {"retry": RetryPolicy(attempts=3, max_total_s=15.0, initial_s=0.2, max_wait_s=2.0)}
    tuning = {"sim": {**quick, "timeout_s": 10.0, "request_interval_s": 0.0, "launch_interval_s": 0.0},
              "lambda": {**quick, "timeout_s": 15.0}, "ec2": {**quick, "read_timeout_s": 20.0},
              **(tuning or {})}
    slots: dict[str, ProviderSlot] = {}
    for name, section in (("sim", cfg.providers.sim), ("lambda", cfg.providers.lambda_)):
        key_file = lambda_cloud.key_file_path(section, environ)
        try:
            key: str | None = lambda_cloud.read_api_key(section, environ)
            problem = None
        except AuthFailed as exc:
            key, problem = None, str(exc)
        provider: Provider | None = None
        if section.enabled and key is not None:
            provider = lambda_cloud.from_config(section, key, sink=sink, orchestrator_id=owner, **tuning.get(name, {}))
        credential = f"file {key_file}" if key_file is not None else f"${section.api_key_env}"
        slots[name] = ProviderSlot(name, section.enabled, credential, key is not None, provider,
                                   problem if section.enabled else None)

    ec2 = cfg.providers.ec2
    problem = _aws_credentials_problem(ec2.profile) if ec2.enabled else None
    present = ec2.enabled and problem is None
    provider = None
    if present:
        from providers.ec2 import Ec2Adapter

        provider = Ec2Adapter(ec2, orchestrator_id=owner, sink=sink, **tuning.get("ec2", {}))
    slots["ec2"] = ProviderSlot("ec2", ec2.enabled, "AWS credential chain", present, provider, problem)
    return slots


def usable(slots: Mapping[str, ProviderSlot]) -> dict[str, Provider]:
    return {n: s.provider for n, s in slots.items() if s.provider is not None}


def key_file_secrets(cfg: Config, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The API keys held in files the config names (`api_key_file`), for the redactor: they are in no environment
    variable it could read them from. A file that cannot be read holds nothing to scrub."""
    from providers import lambda_cloud

    keys = []
    for section in (cfg.providers.sim, cfg.providers.lambda_):
        if section.api_key_file is not None:
            with contextlib.suppress(AuthFailed):
                keys.append(lambda_cloud.read_api_key(section, environ))
    return keys
