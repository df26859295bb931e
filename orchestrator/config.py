"""burstctl's configuration: one pydantic model whose field descriptions are the reference docs.

Resolution order: ``--config``, ``$BURSTCTL_CONFIG``, ``./burstctl.toml``, ``~/.config/burstctl/config.toml``;
with none of them, built-in defaults that need no cloud (the simulated cloud only). ``$BURSTCTL_CONFIG`` set but
empty is bad input, as an empty ``--config`` is: not the defaults.

Secrets are never inline: a provider names the *environment variable* that holds its key (``*_env``).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
import tomllib
import urllib.parse
from datetime import UTC, datetime, time, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.core.gates import MAX_OVERHEAD_H, MAX_RATE_USD_GPU_H
from orchestrator.errors import PATTERN_WORDS, BadInput, FieldValueError, format_validation_error

Market = Literal["auto", "spot", "on-demand"]
JobKind = Literal["train", "eval", "embed", "serve"]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


def _at_most(limit: float, expected: str) -> AfterValidator:
    """A ceiling no real value reaches, so that a value typed in the wrong unit (MiB for GiB, cents for dollars,
    milliseconds for seconds) is refused rather than believed."""
    def check(v: float) -> float:
        if v > limit:
            raise ValueError(f"{v:g} is more than {limit:.15g}: expected {expected}")  # 1000000, not 1e+06
        return v
    return AfterValidator(check)


# A price no GPU-hour has: one typed in cents, or none at all (1e308 made every plan's cost inf).
GPU_HOUR_USD = _at_most(MAX_RATE_USD_GPU_H, "dollars per GPU-hour (an H100 rents for $2 to $12)")

# Ceilings no real setting reaches: past them a number is a slip (or 1e308), which some clock, file size or count
# downstream cannot hold (APScheduler's interval, SQLite's INTEGER, an int of inf): refused here, with the others.
WEEK_S = 7 * 24 * 3600
Seconds = Annotated[float, Field(gt=0), _at_most(WEEK_S, f"seconds, at most a week ({WEEK_S})")]
NonNegSeconds = Annotated[float, Field(ge=0), _at_most(WEEK_S, f"seconds, at most a week ({WEEK_S})")]
Days = Annotated[float, Field(gt=0), _at_most(36500, "days, at most a hundred years")]
Hours = Annotated[float, Field(gt=0), _at_most(8760, "hours, at most a year (8760)")]
NonNegHours = Annotated[float, Field(ge=0), _at_most(8760, "hours, at most a year (8760)")]
Dollars = Annotated[float, Field(ge=0), _at_most(1e6, "dollars, at most a million")]


def _count(limit: int) -> Any:
    return Field(ge=1, le=limit)


GpuGiB = Annotated[float, Field(gt=0), _at_most(
    1024, "GiB as nvidia-smi reports it (memory.total), not MiB (a 16 GB card reads 16303 MiB = 15.92 GiB)")]

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# A name, a job's or an installation's owner tag, is part of file names (decision records) and of instance names
# (Lambda Cloud's, EC2's Name tag): the characters every cloud takes, no path separator, no leading dot.
NAME_PATTERN, NAME_MAX = r"^[A-Za-z0-9][A-Za-z0-9._-]*$", 48
NAME_EXPECTED = f"letters, digits, '.', '_' and '-', starting with a letter or digit, at most {NAME_MAX}"
PATTERN_WORDS[NAME_PATTERN] = f"a name of {NAME_EXPECTED} characters"

ENV_NAME_EXPECTED = ("expected the NAME of an environment variable (letters, digits and '_', not starting with a "
                     "digit) that holds the secret, not the secret itself")


# The shapes of API keys and tokens that are also valid variable names (Stripe-style sk_live_…, GitHub ghp_…,
# Slack xoxb…, AWS AKIA…, Hugging Face hf_…), and any long mix of upper and lower case and digits, which no one
# names a variable: a secret pasted where its variable's name belongs.
SECRET_SHAPED = re.compile(r"(sk|rk|pk)_(live|test)_|gh[pousr]_|github_pat_|xox[abpr]|A[KS]IA[0-9A-Z]{12}|"
                            r"hf_[A-Za-z0-9]{20}")


def _secret_shaped(value: str) -> bool:
    mixed = len(value) >= 20 and not value.isupper() and not value.islower() and any(c.isdigit() for c in value)
    return mixed or SECRET_SHAPED.match(value) is not None


def check_env_name(value: str) -> str:
    """A `*_env` value: the name of the variable that holds a secret. A key pasted here by mistake is the secret
    itself, so the error never quotes the value."""
    if not ENV_NAME.fullmatch(value) or _secret_shaped(value):
        raise ValueError(ENV_NAME_EXPECTED)
    return value


def check_passed_name(value: str) -> str:
    """A job's `pass_env` name: as `check_env_name`, but a name mistyped as one often is ("HF TOKEN", "HF-TOKEN"),
    short, of words without digits, is said with the name it was meant to be."""
    meant = re.sub(r"[ .-]+", "_", value.strip())
    # A key has digits, a passphrase lower case letters: neither is quoted. A name is in capitals.
    wordy = len(value) <= 40 and not any(c.isdigit() for c in value) and value == value.upper()
    if not ENV_NAME.fullmatch(value) and wordy and not _secret_shaped(value) and ENV_NAME.fullmatch(meant):
        raise ValueError(f"'{value}' is not a variable name: expected letters, digits and '_' (not starting with a "
                         f"digit), such as '{meant}'")
    return check_env_name(value)


EnvName = Annotated[str, AfterValidator(check_env_name)]
PassedEnvName = Annotated[str, AfterValidator(check_passed_name)]

KEY_FILE_EXPECTED = ("expected the path of a file that holds the key (absolute, or starting with ~ or $VAR, e.g. "
                     "\"$CREDENTIALS_DIRECTORY/lambda_api_key\"), not the key itself")


def check_key_file(value: str | None) -> str | None:
    """An `api_key_file` value: a path. Anything else is most likely the key pasted in, so it is never quoted."""
    if value is not None and not value.startswith(("/", "~", "$")):
        raise ValueError(KEY_FILE_EXPECTED)
    return value


KeyFile = Annotated[str | None, AfterValidator(check_key_file)]

API_URL_EXPECTED = ("expected the API's root as an https:// URL (plain http:// only to this machine, 127.0.0.1 or "
                    "localhost, as simcloud serves it: the API key goes in every request's header)")


def _split_url(value: str, expected: str) -> urllib.parse.SplitResult:
    """`value` parsed, its port too; else ValueError(`expected`), never quoting it (a URL may carry a password)."""
    try:
        url = urllib.parse.urlsplit(value)
        _ = url.port  # parsed only when asked: "Port could not be cast to integer value as 'abc'"
    except ValueError:  # "Invalid IPv6 URL", a port that is no number: in words that quote it or say nothing
        raise ValueError(expected) from None
    return url


def check_api_url(value: str) -> str:
    """A provider's `base_url`: https, or http on loopback only, so that the bearer key never crosses a network in
    the clear; with a host. A URL may carry a password, so the error does not quote it."""
    url = _split_url(value, API_URL_EXPECTED)
    loopback = url.hostname in ("127.0.0.1", "localhost", "::1")
    if not url.hostname or url.scheme not in ("https", "http") or (url.scheme == "http" and not loopback):
        raise ValueError(API_URL_EXPECTED)
    return value


ApiUrl = Annotated[str, AfterValidator(check_api_url)]

ENDPOINT_URL_EXPECTED = "expected an http(s) URL with a host, e.g. 'http://127.0.0.1:5000' or 'https://s3.example.com'"


def check_endpoint_url(value: str | None) -> str | None:
    """An AWS `endpoint_url`: botocore refused anything else only when the client was made, as an internal error
    quoting it (a URL may carry credentials, so it is not quoted here)."""
    if value is None:
        return value
    url = _split_url(value, ENDPOINT_URL_EXPECTED)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(ENDPOINT_URL_EXPECTED)
    return value


EndpointUrl = Annotated[str | None, AfterValidator(check_endpoint_url)]
KEY_FILE_DESCRIPTION = (
    "A file whose first line is the API key, used instead of the environment variable: e.g. a systemd credential "
    "(LoadCredential=, then \"$CREDENTIALS_DIRECTORY/lambda_api_key\"). ~ and $VARS are expanded. The daemon "
    "watches it: a rotated key is used from its next tick, no restart needed. It must not be readable by other "
    "users (chmod 600).")


class Strict(BaseModel):
    # Unknown fields are refused, and so is a value of the wrong TOML type (`launch_on_notice = "no"` is not
    # false, `monthly_cap_usd = "15"` not 15); an integer still counts as a number.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class HourWindow(Strict):
    """A daily window of wall-clock hours, e.g. 22:00-08:00 (may wrap past midnight)."""

    start: time
    end: time


def _iana_zone(v: str | None) -> str | None:
    """A `timezone` setting: an IANA name this machine's zone database knows, or unset."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if v is not None:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"'{v}' is not a time zone: expected an IANA name such as \"Europe/Berlin\" or "
                             "\"UTC\"") from None
    return v


def _parse_window(value: object) -> object:
    if isinstance(value, str):
        try:
            a, b = value.split("-")
            return {"start": time.fromisoformat(a.strip()), "end": time.fromisoformat(b.strip())}
        except ValueError as exc:
            raise ValueError(f"expected 'HH:MM-HH:MM', got {value!r}") from exc
    return value


class LocalMachine(Strict):
    gpu: str = Field("RTX 5080", description="Local GPU name, for records and tables.")
    vram_gib: GpuGiB = Field(
        15.92, description="Local GPU memory in GiB as nvidia-smi reports it (memory.total), which is less than the "
        "card's marketed size: a \"16 GB\" RTX 5080 reads 16303 MiB = 15.92 GiB.")
    board_power_w: Annotated[float, Field(gt=0), _at_most(5000, "watts (a training GPU draws 100 to 1,200)")] = \
        Field(400.0, description="GPU board power under training load, in watts.")
    electricity_usd_per_kwh: Annotated[float, Field(ge=0), _at_most(5, "dollars per kWh, not cents (25 ¢ is 0.25)")] = \
        Field(0.25, description="Electricity price in $ per kWh; with board power it gives the local $/h.")
    safety_margin_gib: Annotated[float, Field(ge=0), _at_most(1024, "GiB")] = Field(
        1.0, description="VRAM kept free on every card, the local one and rented ones (`[prices]` vram_gib), for the "
        "CUDA context and fragmentation when judging whether a job fits."
    )
    available_hours: list[HourWindow] = Field(
        default_factory=list,
        description="Daily windows of local time when the local GPU may train (e.g. ['22:00-08:00'] if it serves a "
        "desktop by day). A local run is checkpointed when they end and resumes from it when they begin again (one "
        "that cannot resume is never paused: it starts only when its whole run fits in the hours left), and gate "
        "2's T_L is the wall-clock time through them from now. Empty means always.",
    )

    timezone: str | None = Field(
        None, description="IANA time zone `available_hours` are read in (\"Europe/Berlin\"), so that a daemon started "
        "under another TZ (a service manager's UTC, say) keeps the user's hours; unset: this machine's.")

    @field_validator("available_hours", mode="before")
    @classmethod
    def _windows(cls, v: object) -> object:
        if isinstance(v, list):
            return [_parse_window(x) for x in v]
        return v

    _zone = field_validator("timezone")(_iana_zone)

    @model_validator(mode="after")
    def _margin_leaves_memory(self) -> LocalMachine:
        if self.safety_margin_gib >= self.vram_gib:
            raise FieldValueError("safety_margin_gib", f"{self.safety_margin_gib:g} GiB kept free leaves nothing of "
                                  f"the card's {self.vram_gib:g} GiB: expected a GiB or two")
        return self

    @property
    def usd_per_hour(self) -> float:
        return self.board_power_w / 1000.0 * self.electricity_usd_per_kwh

    @property
    def vram_gb(self) -> float:
        return self.vram_gib * 2**30 / 1e9

    @property
    def safety_margin_gb(self) -> float:
        return self.safety_margin_gib * 2**30 / 1e9


class Budget(Strict):
    monthly_cap_usd: Dollars = Field(15.0, description="Hard cap on cloud spend per calendar month (UTC).")
    cycle_gpu_hours: Annotated[float, Field(gt=0), _at_most(1e5, "GPU-hours of one cycle")] = Field(
        1.5, description="GPU-hours of one typical training cycle, for the cycles-left estimate of `budget`."
    )
    cycle_gpu: str = Field("H100", description="GPU type (a key of [prices]) a typical cycle runs on.")
    alert_at: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [0.5, 0.8, 1.0], description="Fractions of monthly_cap_usd: when the month's spend "
        "reaches one, the daemon says so once (`budget.crossed`, a notice by default). [] says nothing.")


def _train_only() -> list[JobKind]:
    return ["train"]


class Policy(Strict):
    max_auto_delta_usd: Dollars = Field(
        5.0,
        description="Largest extra cost, in USD, of a priced job's plan over running it locally (the plan as it will "
        "run, on spot or hybrid: `over local` in `burstctl list`) that the daemon approves without asking; above it "
        "the job waits for `burstctl approve`, unless it is `deadline_critical`. Not ΔC = C_R − C_L, which is all "
        "on-demand.",
    )
    default_market: Market = Field("auto", description="Market for jobs that do not choose: auto|spot|on-demand.")
    cloud_kinds: list[JobKind] = Field(
        default_factory=_train_only,
        description="Job kinds the cloud may run. Only 'train' unless you document a fallback here.",
    )
    overhead_h: Annotated[float, Field(ge=0),
                          _at_most(MAX_OVERHEAD_H, "hours, not minutes (half an hour is 0.5)")] = Field(
        0.5, description="Provisioning + sync + teardown overhead t_ovh, in hours, used until burstctl has measured it."
    )
    spot_preemptions_per_hour: Annotated[float, Field(ge=0), _at_most(
            60, "preemptions an hour (0.05 is one every 20 hours)")] = Field(
        0.05, description="Expected spot preemptions per hour: the prior that this installation's own spot "
        "instances (30 days, every provider and type) are shrunk towards, and the figure used until there are any."
    )
    spot_mean_outage_hours: Hours = Field(
        1.0, description="Expected length of a spot outage (launches refused for lack of capacity), until the "
                         "daemon's own sightings say otherwise.",
    )
    hybrid_margin_h: NonNegHours = Field(
        0.25, description="Slack kept before the deadline by hybrid local-then-burst plans (provisioning, no capacity)."
    )


class GpuPrice(Strict):
    on_demand_usd_h: Annotated[PositiveFloat, GPU_HOUR_USD] = Field(description="On-demand $/GPU-hour.")
    spot_usd_h: Annotated[PositiveFloat, GPU_HOUR_USD] | None = Field(
        None, description="Spot $/GPU-hour, if a spot market exists.")
    vram_gib: GpuGiB = Field(
        79.65, description="Memory per GPU in GiB as nvidia-smi reports it (memory.total), less than the marketed "
        "size: H100 80GB 81559 MiB = 79.65 GiB, A100 80GB 80, A10/A10G 23028 MiB = 22.49 GiB, L40S 44.99, H200 140.4.")


def _default_prices() -> dict[str, GpuPrice]:
    # Reference figures, to be edited to what the user pays. The last five are the GPUs of the EC2 adapter's type
    # table (providers/ec2.py GPU_TABLE) with no figure above: AWS's on-demand list price per GPU-hour (us-east-1,
    # 2025: p3.2xlarge, g6e.xlarge, g6.xlarge, g4dn.xlarge, p5en.48xlarge / 8) and a typical spot price.
    return {
        "H100": GpuPrice(on_demand_usd_h=3.00, spot_usd_h=1.00, vram_gib=79.65),
        "A100": GpuPrice(on_demand_usd_h=1.80, spot_usd_h=0.65, vram_gib=80),
        "A10": GpuPrice(on_demand_usd_h=0.75, spot_usd_h=0.25, vram_gib=22.49),
        "V100": GpuPrice(on_demand_usd_h=3.06, spot_usd_h=0.97, vram_gib=15.78),  # V100 16GB: 16160 MiB
        "L40S": GpuPrice(on_demand_usd_h=1.86, spot_usd_h=0.70, vram_gib=44.99),  # 46068 MiB
        "L4": GpuPrice(on_demand_usd_h=0.80, spot_usd_h=0.30, vram_gib=22.49),  # 23034 MiB
        "T4": GpuPrice(on_demand_usd_h=0.53, spot_usd_h=0.21, vram_gib=15.0),  # 15360 MiB
        "H200": GpuPrice(on_demand_usd_h=7.91, spot_usd_h=3.00, vram_gib=140.4),  # 143771 MiB
    }


class SimProvider(Strict):
    enabled: bool = Field(True, description="Use the project's simulated cloud (simcloud).")
    base_url: ApiUrl = Field("http://127.0.0.1:8790/api/v1", description="simcloud's Lambda-compatible API root.")
    api_key_env: EnvName = Field("BURSTCTL_SIM_API_KEY", description="Env var holding simcloud's API key.")
    api_key_file: KeyFile = Field(None, description=KEY_FILE_DESCRIPTION)
    ssh_key_name: str = Field("burstctl", description="SSH key name registered with the provider.")
    lists_spot_capacity: bool = Field(
        True, description="Read simcloud's spot capacity listing, so spot is seen without launching. false: spot "
                          "is seen only by launching, as on EC2.",
    )


# The regions Lambda Cloud's API names (`PublicRegionCode` in its OpenAPI contract, 1.8.3): a launch anywhere else
# is refused, so a misspelt region would leave a job waiting for capacity that can never be listed there.
LAMBDA_REGIONS = ("asia-northeast-1", "asia-northeast-2", "asia-south-1", "australia-east-1", "europe-central-1",
                  "me-west-1", "us-east-1", "us-east-2", "us-east-3", "us-midwest-1", "us-midwest-2", "us-south-1",
                  "us-south-2", "us-south-3", "us-west-1", "us-west-2", "us-west-3")


class LambdaProvider(Strict):
    enabled: bool = Field(False, description="Use Lambda Cloud.")
    base_url: ApiUrl = Field("https://cloud.lambda.ai/api/v1", description="API root: https, or http to this machine "
                             "only (simcloud, a test server).")
    api_key_env: EnvName = Field("LAMBDA_API_KEY", description="Env var holding the Lambda Cloud API key.")
    api_key_file: KeyFile = Field(None, description=KEY_FILE_DESCRIPTION)
    ssh_key_name: str = Field(
        "burstctl", description="The name burstctl registers its SSH public key under (beside it, `<name>-<hash>`, "
                                "when that name holds another key).")
    regions: list[str] = Field(default_factory=list, description="Allowed regions in preference order (Lambda's "
                               "codes, such as \"us-east-1\"); empty = any.")
    instance_types: list[str] = Field(
        default_factory=list, description="Instance types the daemon may launch (Lambda's names, such as "
        "\"gpu_1x_h100_sxm5\"); empty = any GPU type listed. Among the offers a job can use (a GPU type and count it "
        "names, with capacity), across providers, the daemon takes the lowest price per unit of work; this order "
        "only breaks ties. A launch never falls back to another type: after a refusal for capacity the daemon "
        "chooses again, that offer last.")

    @field_validator("regions")
    @classmethod
    def _known_regions(cls, v: list[str]) -> list[str]:
        if unknown := [r for r in v if r not in LAMBDA_REGIONS]:
            named = ", ".join(repr(r) for r in unknown)
            raise ValueError(f"{named}: not {'a region' if len(unknown) == 1 else 'regions'} Lambda Cloud has; "
                             f"expected among {', '.join(LAMBDA_REGIONS)}")
        return v


class Ec2Provider(Strict):
    enabled: bool = Field(False, description="Use AWS EC2.")
    region: str = Field("us-east-1", description="AWS region.")
    profile: str | None = Field(None, description="AWS profile of the standard credential chain.")
    endpoint_url: EndpointUrl = Field(None, description="Override endpoint (moto's server); AWS_ENDPOINT_URL works "
                                      "too.")
    ami: str = Field("ami-12c6146b", description="Image with the GPU driver and Python, in `region`. The default is "
                     "a placeholder (the tests' image): replace it.")
    key_name: str = Field("burstctl", description="EC2 key pair name.")
    security_group_ids: list[str] = Field(
        default_factory=list, description="Security groups of the instances; they must allow SSH inbound (ssh_port) "
        "from this machine.")
    subnet_ids: dict[str, str] = Field(default_factory=dict, description="Subnet per availability zone.")
    instance_profile: str | None = Field(None, description="IAM instance profile name (e.g. for S3 checkpoints).")
    user_data: str | None = Field(
        None, description="cloud-init user data for every instance (plain text; boto3 base64-encodes it)."
    )
    instance_types: list[str] = Field(
        default_factory=lambda: ["p3.2xlarge"], description="Instance types offered, each priced in "
        "`on_demand_usd_h` (a type without a price is skipped). Among the offers a job can use (a GPU type and count "
        "it names), across providers, the daemon takes the lowest price per unit of work; this order only breaks "
        "ties. A launch never falls back to another type: after a refusal for capacity the daemon chooses again, that "
        "offer last.")
    zones: list[str] = Field(
        default_factory=list, description="Availability zones a launch tries, in this order, going on to the next "
        "only when one has no capacity; empty = every available zone of the region, in name order. An offer's spot "
        "price is the highest of these zones' prices.")
    on_demand_usd_h: dict[str, Annotated[float, Field(gt=0), _at_most(
            MAX_RATE_USD_GPU_H * 16, "dollars per instance-hour")]] = Field(
        default_factory=lambda: {"p3.2xlarge": 3.06}, description="On-demand $/h per instance type."
    )
    ssh_user: str = Field("ubuntu", description="Login user on the image.")
    ssh_address: Literal["public", "private"] = Field(
        "public", description="Which instance address to SSH to: `public`, or `private` from inside the VPC (a VPN, "
        "a bastion, or the simulated EC2, whose instances have 127.x private addresses).")
    ssh_port: Annotated[int, Field(ge=1, le=65535)] = Field(22, description="SSH port on the instances.")
    checkpoint_bucket: str | None = Field(
        None, description="S3 bucket for checkpoints. Set: each instance uploads its checkpoints there in-region "
        "(it needs boto3 on the image and credentials, normally through `instance_profile`: s3:ListBucket, "
        "GetObject, PutObject, DeleteObject on the prefix), the daemon downloads them home from there, and a "
        "resumed attempt downloads its starting point in-region. If the instance cannot upload, the attempt "
        "falls back to SSH. Unset: checkpoints travel over SSH only.")
    checkpoint_prefix: str = Field("burstctl", description="Key prefix in the bucket; a job gets <prefix>/<job id>/.")
    s3_endpoint_url: EndpointUrl = Field(
        None, description="S3 endpoint for the daemon (an S3-compatible store, or moto's server); "
        "AWS_ENDPOINT_URL_S3 works too.")


class Providers(Strict):
    sim: SimProvider = Field(default_factory=SimProvider)
    lambda_: LambdaProvider = Field(default_factory=LambdaProvider, alias="lambda")
    ec2: Ec2Provider = Field(default_factory=Ec2Provider)

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


class DaemonSettings(Strict):
    tick_s: Annotated[float, Field(gt=0), _at_most(600, "seconds, not milliseconds (the default is 5)")] = Field(
        5.0, description="Reconcile tick in seconds: every job advances one step per tick.")
    sweep_s: Seconds = Field(120.0, description="How often every provider is swept for orphaned instances.")
    heartbeat_timeout_s: Seconds = Field(
        60.0, description="A running attempt whose heartbeat is older than this is treated as preempted (one SSH "
        "does not answer: for this long while a daemon watched, the time it was stopped or its machine asleep not "
        "counted); and a step that fails in a row for this long of watched time (five tries at least) is given up.")
    boot_timeout_s: Seconds = Field(
        900.0, description="Give up on an instance that is not reachable by SSH this long after its launch (it is "
        "terminated and launched again); the time the provider's API did not answer (throttled, failing), and the time "
        "no daemon watched (stopped, or its machine asleep), is not counted.")
    max_cloud_attempts: Annotated[int, _count(1000)] = Field(
        4, description="Cloud attempts running at once, spot probes included.")
    max_launch_failures: Annotated[int, _count(1000)] = Field(
        3, description="Consecutive failed launches before a job waits (blocked, with the reason)."
    )
    launch_backoff_s: NonNegSeconds = Field(60.0, description="Wait after a failed launch before trying again.")
    redecide_per_tick: Annotated[int, _count(100_000)] = Field(
        50, description="Blocked jobs re-decided per tick (budget freed, kill switch lifted)."
    )
    local_concurrency: Annotated[int, Field(ge=0, le=64)] = Field(
        1, description="Local GPU jobs at once (one GPU: 1). 0: none, and gate 1 finds no local option for any job "
                       "(every job that may burst is decided for the cloud).")
    offers_ttl_s: Seconds = Field(
        60.0, description="How long providers' offers (prices, capacity, spot capacity) are reused before asking again."
    )
    market_check_s: Seconds = Field(
        60.0, description="How often a running cloud attempt asks the spot policy whether to change market (the "
                          "policy's tick); and how often a local run still late after a re-plan is decided again.",
    )
    spot_probe_max_s: NonNegSeconds = Field(
        900.0, description="Where spot is seen only by launching (EC2), a job waiting for spot probes it with a "
                           "launch every launch_backoff_s at first, then every tenth of the outage so far, and at "
                           "least this often (the longest gap between probes): a long outage leaves tens of refused "
                           "attempts, not one a minute.",
    )
    spot_probe_on_demand: bool = Field(
        True, description="Where spot is seen only by launching (EC2), a job on on-demand whose spot policy would go "
                          "back to spot were it up probes spot on the same schedule: a spot launch of the same "
                          "type beside the running instance (a refusal costs nothing). One that comes up is kept: "
                          "the job is checkpointed off on-demand and resumes on it. Off: on-demand is final, as "
                          "without a listing.",
    )
    launch_on_notice: bool = Field(
        True, description="Make before break on a spot interruption notice: the job's next instance is launched "
                          "(on the market and offer its policy picks, away from the zone being reclaimed) and boots "
                          "while the noticed one writes its last checkpoint; it is bootstrapped from that checkpoint "
                          "once the noticed attempt has ended. Off: the next launch waits for that end.",
    )
    sync_workers: Annotated[int, Field(ge=0, le=64)] = Field(
        4, description="Cloud attempts' syncs (newest checkpoint, outputs, logs: periodic, and the last one when a "
                       "run ends or is stopped) that run at once, on threads beside the tick: a multi-GB pull then "
                       "holds up no other attempt's heartbeat, interruption notice or stop. 0: each sync runs inside "
                       "the tick, one after another.")
    pull_kib_s: Annotated[int, _count(10**8)] | None = Field(
        None, description="Cap, in KiB/s, on the rate at which each checkpoint is pulled home over SSH (rsync "
                          "--bwlimit, or paced SFTP), so a multi-GB pull leaves a home link room for everything "
                          "else. Unset: as fast as the link goes. Checkpoints that come home from S3 are not capped.")

    @property
    def policy_tick_h(self) -> float:
        """The spot policy's tick: how often the daemon asks it about a running attempt."""
        return max(self.tick_s, self.market_check_s) / 3600.0


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "burstctl"


class StateSettings(Strict):
    dir: Path = Field(default_factory=default_state_dir, strict=False,  # a TOML string is a path
                      description="State directory: database, logs, records. A relative path is read from the config "
                      "file's directory.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///<dir>/burstctl.db (a relative SQLite path is read "
        "from the config file's directory). PostgreSQL works too "
        "(postgresql+psycopg://user@host/db, with `pip install burstctl[postgres]`). A password is never written "
        "here: libpq reads it from PGPASSWORD or ~/.pgpass.",
    )
    events_file_max_mb: Annotated[float, Field(gt=0), _at_most(1e6, "MB, at most a million (a terabyte)")] = Field(
        64.0, description="<dir>/events.jsonl is rotated to events.jsonl.1 (.1 to .2, ...) once it passes this "
        "size, so months of a daemon's log stay bounded. The events table keeps every event.")
    events_files_kept: Annotated[int, _count(1000)] = Field(
        4, description="Rotated events.jsonl.N files kept; the oldest beyond these is deleted.")
    events_keep_days: Days | None = Field(
        None, description="The daemon deletes, once a day, the events and the attempts' logs (<state>/runs/) of jobs "
        "finished longer ago than this many days (and events of no job as old); unset keeps them all. Jobs, attempts, "
        "the ledger, decision records, checkpoints and outputs stay. `burstctl prune-events --older-than DAYS` does "
        "the same by hand.")
    checkpoints_keep_days: Days | None = Field(
        None, description="The daemon deletes, once a day, the checkpoints (<state>/checkpoints/<job>/) of jobs done "
        "longer ago than this many days; unset keeps them. A done job keeps only its newest checkpoint anyway, and a "
        "failed or cancelled one keeps all of its own (`burstctl retry` resumes from them). A job's `outputs` stay. "
        "`burstctl prune-events --older-than DAYS --checkpoints` does the same by hand.")

    @field_validator("dir", mode="before")
    @classmethod
    def _a_directory(cls, v: object) -> object:
        if isinstance(v, str) and not v.strip():  # Path("") is the current directory: a slip, as --state-dir ""
            raise ValueError("is empty: expected a path (left out: $XDG_STATE_HOME/burstctl or "
                             "~/.local/state/burstctl)")
        return v

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, v: str | None) -> str | None:
        # Messages never quote the URL: it could hold a password.
        if v is None:
            return v
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        try:
            url = make_url(v)
            port = url.port
        except (ArgumentError, ValueError):
            # A ValueError is SQLAlchemy's int() of what it took for the port, and quotes it: in
            # "postgresql://burst:PASSWORD/db" (no host) that is the password.
            raise ValueError("is not a database URL: expected e.g. 'postgresql+psycopg://burst@db.example/burstctl'"
                             " or 'sqlite:////var/lib/burstctl/burstctl.db'") from None
        if port is not None and not 1 <= port <= 65535:
            raise ValueError("has a port that is not one: expected a port from 1 to 65535 after the host, e.g. "
                             "'postgresql+psycopg://burst@db.example:5432/burstctl'")
        if url.password is not None or any(k.lower() == "password" for k in url.query):
            raise ValueError("holds a password: secrets are never written inline; give it in PGPASSWORD or "
                             "~/.pgpass, which libpq reads") from None
        if url.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError(f"names the '{url.get_backend_name()}' database: expected SQLite or PostgreSQL")
        if url.get_backend_name() == "sqlite" and (url.database in (None, "", ":memory:")
                                                  or url.query.get("mode") == "memory"):
            # Each process would have its own, gone when it ends: no command would see the daemon's queue.
            raise ValueError("is an in-memory database, which no other process sees and which is gone when its own "
                             "ends: expected a file, e.g. 'sqlite:////var/lib/burstctl/burstctl.db'")
        try:
            url.get_dialect().import_dbapi()
        except (ImportError, NoSuchModuleError):
            hint = " (pip install 'burstctl[postgres]')" if url.get_backend_name() == "postgresql" else ""
            raise ValueError(f"needs the '{url.drivername}' driver, which is not installed{hint}") from None
        return v


CRON_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
CRON_EXPECTED = ("expected five crontab fields, minute hour day-of-month month day-of-week, e.g. \"0 2 * * mon\" "
                 "(Mondays at 02:00), or @hourly, @daily, @weekly, @monthly, @yearly")


class Schedule(Strict):
    """A job queued again and again: a weekly fine-tune is a cycle a week. Each cycle is decided on its own when its
    slot comes (gates, market, this month's budget), as `burstctl enqueue` would."""

    job: Path = Field(strict=False, description="The job file, relative to this config file (or absolute). It is "
                      "read at each slot, so an edit applies from the next cycle. Its deadline must be "
                      "`deadline_hours`, counted from the slot.")
    cron: str = Field(description="When: a five-field crontab, minute hour day-of-month month day-of-week, read in "
                      "`timezone` (\"0 2 * * mon\": Mondays at 02:00; \"30 1 1,15 * *\": the 1st and 15th at 01:30), "
                      "or one of cron's nicknames (@hourly, @daily or @midnight, @weekly, @monthly, @yearly or "
                      "@annually). Its slots must be at least `daemon.tick_s` apart.")
    timezone: str | None = Field(None, description="IANA time zone the cron is read in (\"Europe/Berlin\"); unset: "
                                 "this machine's.")
    overlap: Literal["skip", "queue"] = Field(
        "skip", description="A slot that comes while the previous cycle is not over: skip it (said, with "
        "`schedule.skipped`), or queue the new cycle beside it.")

    @field_validator("cron")
    @classmethod
    def _crontab(cls, v: str) -> str:
        from apscheduler.triggers.cron import CronTrigger  # only with a schedule: the CLI's start stays lean

        from orchestrator.core import crontab

        try:
            triggers = [CronTrigger.from_crontab(c) for c in crontab.as_apscheduler(v)]
        except ValueError as exc:
            # Five fields, one out of range ("61 9 * * *"): say which value, not "expected five fields".
            bad = re.search(r"last value \((\d+)\) is higher than the maximum value \((\d+)\)", str(exc))
            if len(v.split()) == 5 and bad:
                field = next((name for name, text in zip(CRON_FIELDS, v.split(), strict=True)
                              if bad.group(1) in re.split(r"[^0-9]", text)), "a field")
                raise ValueError(f"'{v}': {field} {bad.group(1)} is more than {bad.group(2)}: {CRON_EXPECTED}") \
                    from None
            raise ValueError(f"'{v}' is not a crontab: {CRON_EXPECTED}") from None
        # A valid cron may still name a day no month has ("0 2 30 2 *"): it would never queue a cycle, unsaid.
        now = datetime.now(UTC)
        if all(t.get_next_fire_time(None, now) is None for t in triggers):
            raise ValueError(f"'{v}' matches no date (a day its months do not have): it would never queue a cycle")
        return v

    _zone = field_validator("timezone")(_iana_zone)


# What a person should hear of without watching `status`: the notices `[[notify]]` sends when it names none.
DEFAULT_NOTICES = ["job.done", "job.failed", "job.awaiting_approval", "job.rethink", "job.blocked",
                   "job.behind_schedule", "budget.crossed", "schedule.missed", "schedule.job_invalid",
                   "instance.terminate_unverified", "instance.orphan_terminate_failed", "attempt.provider_unavailable",
                   "attempt.provider_refused", "attempt.release_held", "daemon.config_rejected", "daemon.lock_lost"]
NOTIFIER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The kinds of event there are (the part of a type before its dot): a notifier's pattern naming none would never
# match (`jobs.*`), unsaid. A test checks that every event emitted is of one of them.
EVENT_FAMILIES = ("attempt", "budget", "burst", "checkpoint", "cloud", "daemon", "instance", "job", "notify",
                  "preemption", "provider", "revert_local", "schedule", "spot", "state")
# Every event type burstctl records, and the notice types a decision's state gives a job (`notify.notice_type`):
# a notifier's pattern that names none of them (`job.fialed`) would send nothing, unsaid. A test holds this to the
# code (tests/test_notify.py).
EVENT_TYPES = frozenset({
    "attempt.ended", "attempt.error", "attempt.hand_over_held", "attempt.host_key_mismatch", "attempt.intent",
    "attempt.last_checkpoint_failed", "attempt.launch_failed", "attempt.launch_unknown", "attempt.logs_pull_failed",
    "attempt.lost_work_corrected", "attempt.market_switch", "attempt.outputs_copy_failed",
    "attempt.outputs_pull_failed", "attempt.probe_taken_over", "attempt.provider_answers", "attempt.provider_refused",
    "attempt.provider_unavailable", "attempt.release_held", "attempt.released", "attempt.running",
    "attempt.setup_started_early", "attempt.spot_probe", "attempt.stop_requested", "attempt.stopping",
    "attempt.successor_taken_over",
    "budget.crossed",
    "burst.disabled", "burst.enabled",
    "checkpoint.corrupt", "checkpoint.lost", "checkpoint.lost_corrected", "checkpoint.rejected",
    "checkpoint.s3_answers", "checkpoint.s3_download_failed", "checkpoint.s3_refused", "checkpoint.s3_release_failed",
    "checkpoint.s3_released", "checkpoint.s3_unavailable",
    "checkpoint.sync_failed", "checkpoint.synced",
    "cloud.health",
    "daemon.config_rejected", "daemon.config_reloaded", "daemon.lock_lost", "daemon.notify_failed",
    "daemon.orphan_transfers_ended", "daemon.schedule_failed", "daemon.started", "daemon.stopped", "daemon.stopping",
    "daemon.sweep_failed", "daemon.tick_failed", "daemon.unwatched",
    "instance.adopted", "instance.confirmed_gone", "instance.host_key_recorded", "instance.interruption_notice",
    "instance.launched", "instance.orphan_terminate_failed", "instance.orphan_terminated", "instance.preempted",
    "instance.ready",
    "instance.terminate_retry", "instance.terminate_unverified", "instance.terminated",
    "job.approved", "job.awaiting_approval", "job.behind_schedule", "job.blocked", "job.cancelled", "job.decided",
    "job.done", "job.enqueued", "job.failed", "job.market_switch", "job.measured", "job.outputs_home",
    "job.plan_restored", "job.redecided", "job.replanned", "job.requeued_local", "job.resumed", "job.resuming",
    "job.rethink", "job.retried", "job.switching", "job.waiting",
    "notify.armed", "notify.failed", "notify.recovered", "notify.removed", "notify.test",
    "preemption.error",
    "provider.call", "provider.launch_fallback", "provider.launch_found_existing", "provider.launched",
    "provider.offer_skipped", "provider.retry", "provider.unavailable", "provider.unreachable",
    "revert_local.done", "revert_local.resume_from_home",
    "schedule.armed", "schedule.job_invalid", "schedule.missed", "schedule.queued", "schedule.removed",
    "schedule.skipped",
    "spot.notice", "spot.preempted",
    "state.checkpoints_pruned", "state.events_pruned",
})


class Notify(Strict):
    """Where the daemon sends notices of the events a person should hear of: a webhook (`url_env`) or a command,
    exactly one of the two. Notices go in the order their events happened, none skipped: one that cannot be
    delivered is tried again (5 s, doubling, at most 15 min) before any later one."""

    name: str = Field(description="The notifier's name, in events and `burstctl status`, and the key of its place "
                      "in the event log: renaming it starts it afresh from the newest event.")
    url_env: EnvName | None = Field(
        None, description="The environment variable holding the webhook's URL. Slack, Discord, Mattermost and ntfy "
        "put their token in the URL, so it is treated as a secret: never in the config, an event or an error. Each "
        "notice is POSTed to it; any 2xx is delivered.")
    format: Literal["json", "slack", "text"] = Field(
        "json", description="The webhook's body: `json` (the notice: id, type, text, job, event data), `slack` "
        "({\"text\": ...}: Slack, Mattermost, Rocket.Chat) or `text` (the line as text/plain: ntfy).")
    command: list[str] | None = Field(
        None, description="A command run for each notice, with the notice as JSON on its stdin; `{text}`, `{type}` "
        "and `{job}` in its arguments are replaced (e.g. [\"notify-send\", \"burstctl\", \"{text}\"]). Exit 0 is "
        "delivered.")
    events: list[str] = Field(
        default_factory=lambda: list(DEFAULT_NOTICES), min_length=1,
        description="The notices to send: event types, `*` a wildcard (\"job.*\", \"*\"). A job queued, decided "
        "again or retried into a state that needs a person is `job.awaiting_approval`, `job.blocked` or "
        "`job.rethink`. The notifiers' own `notify.*` events are never sent.")
    timeout_s: Seconds = Field(10.0, description="How long one delivery may take before it counts as failed.")
    digest_over: Annotated[int, _count(100_000)] = Field(
        5, description="When more notices than this are due at once (a hundred jobs done in one tick, the backlog "
        "of a webhook that was down), they go as one digest: its first line counts them, then a line each (the "
        "first 20 in the text; all of them in the JSON's `notices`).")
    secret_env: EnvName | None = Field(
        None, description="The environment variable holding a shared secret: each webhook POST then carries "
        "`X-Burstctl-Signature: sha256=<hex>`, the HMAC-SHA256 of its exact body with that secret, so the receiver "
        "can tell notices from burstctl from forgeries. Treated as a secret like the URL.")

    @field_validator("events")
    @classmethod
    def _known_kinds(cls, v: list[str]) -> list[str]:
        for pattern in v:
            family, dot, _ = pattern.partition(".")
            if any(c in family for c in "*?["):
                continue
            if not dot or family not in EVENT_FAMILIES:
                near = difflib.get_close_matches(family, EVENT_FAMILIES, n=1)
                hint = f" (did you mean '{near[0]}{dot or '.'}{pattern.partition('.')[2] or '*'}'?)" if near else ""
                raise ValueError(f"'{pattern}' matches no event: expected an event type such as 'job.done' or a "
                                 f"pattern such as 'job.*', of {', '.join(EVENT_FAMILIES)}{hint}")
            if not any(fnmatch.fnmatchcase(kind, pattern) for kind in EVENT_TYPES):  # a typo: nothing would be sent
                of_family = sorted(k for k in EVENT_TYPES if k.startswith(f"{family}."))
                near = difflib.get_close_matches(pattern, of_family, n=1)
                raise ValueError(f"'{pattern}' matches no event type burstctl records"
                                 + (f" (did you mean '{near[0]}'?)" if near else "")
                                 + f": expected one of {', '.join(of_family)}, or a pattern such as '{family}.*'")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NOTIFIER_NAME.fullmatch(v):
            raise ValueError(f"'{v}' is not a notifier name: expected letters, digits, '.', '_' and '-'")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> Notify:
        if (self.url_env is None) == (self.command is None):
            raise ValueError("expected exactly one of url_env (a webhook) and command")
        if self.command is not None and not self.command:
            raise FieldValueError("command", "empty: expected the program and its arguments, e.g. "
                                  "[\"notify-send\", \"burstctl\", \"{text}\"]")
        if self.command is not None and self.format != "json":
            raise FieldValueError("format", "only a webhook (url_env) has a format: a command gets the notice as JSON")
        if self.command is not None and self.secret_env is not None:
            raise FieldValueError("secret_env", "only a webhook (url_env) is signed: a command runs on this machine")
        return self


class Config(Strict):
    local: LocalMachine = Field(default_factory=LocalMachine)
    budget: Budget = Field(default_factory=Budget)
    policy: Policy = Field(default_factory=Policy)
    prices: dict[str, GpuPrice] = Field(
        default_factory=_default_prices,
        description="Reference $/GPU-hour per GPU type, used for decisions when no live offer is known.",
    )
    providers: Providers = Field(default_factory=Providers)
    state: StateSettings = Field(default_factory=StateSettings)
    daemon: DaemonSettings = Field(default_factory=DaemonSettings)
    schedule: list[Schedule] = Field(
        default_factory=list, description="Jobs queued on a schedule ([[schedule]] tables), one per job file: the "
        "daemon queues each cycle when its slot comes (`burstctl schedules` lists them).")
    notify: list[Notify] = Field(
        default_factory=list, description="Where the daemon sends notices ([[notify]] tables): a job done or failed, "
        "one waiting for approval, a slot missed, an instance not confirmed gone (`burstctl notify-test` tries "
        "them).")
    orchestrator_id: Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)] | None = Field(
        None, description="Owner tag on every instance this installation creates. Unset: one is made for this state "
        "on first use and kept in it (`burstctl-` and 8 hex digits; a state from before that keeps `burstctl`). Two "
        "installations on one cloud account must not share it: each one's sweep and revert-local terminate the "
        "instances with its tag that it has no attempt for.")

    source: str | None = Field(None, exclude=True, description="Where this config came from (set by the loader).")

    @model_validator(mode="after")
    def _cycle_gpu_priced(self) -> Config:
        if self.budget.cycle_gpu not in self.prices:
            whole = ("; the file's [prices] replaces the built-in prices whole: expected it to list this GPU too, "
                     "or budget.cycle_gpu to name one it lists" if "prices" in self.model_fields_set else "")
            raise FieldValueError("budget.cycle_gpu", f"'{self.budget.cycle_gpu}' has no entry in [prices] "
                                  f"(known: {', '.join(sorted(self.prices))}){whole}")
        return self

    @model_validator(mode="after")
    def _one_schedule_per_job(self) -> Config:
        seen: set[Path] = set()
        for k, sched in enumerate(self.schedule):
            path = self.schedule_job(sched)
            if path in seen:
                raise FieldValueError(f"schedule.{k}.job", f"'{sched.job}' has a schedule already: expected one "
                                      "[[schedule]] per job file (several slots fit in one cron, e.g. \"0 2 * * "
                                      "mon,thu\")")
            seen.add(path)
        return self

    @model_validator(mode="after")
    def _slots_a_tick_apart(self) -> Config:
        if (too_close := self.schedule_slots_closer_than(self.daemon.tick_s, "daemon.tick_s")) is not None:
            raise too_close
        return self

    def schedule_slots_closer_than(self, tick_s: float, tick_name: str) -> FieldValueError | None:
        """A schedule whose slots are closer together than the daemon's ticks (`tick_name`: where that tick is set),
        said as the error to raise; None if there is none. Each tick would pass some slots by, each time said as
        missed."""
        if tick_s <= 60:  # cron's slots are whole minutes apart at the least: always the case
            return None
        for k, sched in enumerate(self.schedule):
            gap = _closest_slots_s(sched)
            if gap is not None and gap < tick_s:
                return FieldValueError(f"schedule.{k}.cron", f"'{sched.cron}' has slots {gap:.0f} s apart, closer "
                                       f"than {tick_name} ({tick_s:g} s): expected slots at least a tick apart, or a "
                                       "shorter tick")
        return None

    @model_validator(mode="after")
    def _notifier_names_unique(self) -> Config:
        seen: set[str] = set()
        for k, n in enumerate(self.notify):
            if n.name in seen:
                raise FieldValueError(f"notify.{k}.name", f"'{n.name}' names another [[notify]] already: expected "
                                      "one name per notifier")
            seen.add(n.name)
        return self

    def schedule_job(self, sched: Schedule) -> Path:
        """A schedule's job file: relative to the config file it was read from."""
        base = Path(self.source).parent if self.source else Path.cwd()
        return (base / sched.job.expanduser()).resolve()

    def from_config_file(self, path: Path) -> Path:
        """A path the config file gives, relative to the file's directory (as a schedule's job is): a daemon started
        elsewhere (systemd starts it in ~) and a command run here must find the same state."""
        path = path.expanduser()
        if path.is_absolute() or not self.source:
            return path
        return Path(os.path.abspath(self.source)).parent / path

    @property
    def state_dir(self) -> Path:
        return self.from_config_file(self.state.dir)

    @property
    def database_url(self) -> str:
        url = self.state.database_url
        if url is None:
            return f"sqlite:///{self.state_dir / 'burstctl.db'}"
        if not url.startswith("sqlite"):
            return url
        from sqlalchemy.engine import make_url

        u = make_url(url)  # a SQLite file's path, relative to the config file too
        if not u.database or u.database == ":memory:" or u.database.startswith("file:"):
            return url
        path = self.from_config_file(Path(u.database))
        return url if str(path) == u.database else u.set(database=str(path)).render_as_string(hide_password=False)

    def secret_env_names(self) -> list[str]:
        p = self.providers
        names = [p.sim.api_key_env, p.lambda_.api_key_env, "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "PGPASSWORD", *(n.url_env for n in self.notify if n.url_env),
                 *(n.secret_env for n in self.notify if n.secret_env)]
        return [n for n in names if n]


def _closest_slots_s(sched: Schedule, looks: int = 64) -> float | None:
    """The least time between two of the schedule's next `looks` slots (None: fewer than two to come)."""
    from apscheduler.triggers.cron import CronTrigger

    from orchestrator.core import crontab

    triggers = [CronTrigger.from_crontab(c, timezone=sched.timezone) for c in crontab.as_apscheduler(sched.cron)]
    at, slots = datetime.now(UTC), []
    for _ in range(looks):
        nxt = min((t for trig in triggers if (t := trig.get_next_fire_time(None, at)) is not None), default=None)
        if nxt is None:
            break
        slots.append(nxt.timestamp())
        at = nxt + timedelta(seconds=1)
    return min((b - a for a, b in pairwise(slots)), default=None)


def config_candidates(explicit: str | None) -> list[tuple[Path, bool]]:
    """(path, must_exist) in resolution order. A $BURSTCTL_CONFIG set but empty, where it would be read (no
    `explicit` file), is bad input: an env file's `BURSTCTL_CONFIG=`, or a script's unset variable, meant a file, and
    running on the defaults (another state, the simulated cloud only) would not say so."""
    out: list[tuple[Path, bool]] = []
    if explicit:
        out.append((Path(explicit), True))
    env = os.environ.get("BURSTCTL_CONFIG")
    if env is not None and not env.strip() and not explicit:
        raise BadInput("is set but empty: expected the path of a config file (unset it for ./burstctl.toml, "
                       "~/.config/burstctl/config.toml or the built-in defaults)", source="$BURSTCTL_CONFIG")
    if env and env.strip():
        out.append((Path(env), True))
    out.append((Path("burstctl.toml"), False))
    out.append((Path.home() / ".config" / "burstctl" / "config.toml", False))
    return out


def toml_value(v: Any) -> str:
    """A value as TOML: strings, numbers, booleans, and lists and inline tables of them (tomllib only reads)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def read_toml(path: Path) -> dict:
    try:
        if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or a device: reading waits for ever
            raise BadInput("is not a regular file, expected a TOML file", source=path)
        with path.open("rb") as fh:
            # A byte-order mark, as some Windows editors write: not TOML, and harmless.
            return tomllib.loads(fh.read().removeprefix(b"\xef\xbb\xbf").decode())
    except FileNotFoundError:
        raise BadInput("file not found", source=path) from None
    except IsADirectoryError:
        raise BadInput("is a directory, expected a TOML file", source=path) from None
    except OSError as exc:  # a file another user's mode keeps from this one, a disk that fails
        raise BadInput(f"cannot be read ({exc.strerror or type(exc).__name__})", source=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"not valid TOML ({exc})", source=path) from None
    except UnicodeDecodeError:
        raise BadInput("not valid TOML (not UTF-8 text)", source=path) from None


def load_config(explicit: str | None = None, state_dir: str | None = None) -> Config:
    cfg, problem = load_config_for_state(explicit, state_dir)
    if problem is not None:
        raise problem
    return cfg


def load_config_for_state(explicit: str | None = None, state_dir: str | None = None) -> tuple[Config, BadInput | None]:
    """The config, and None; or, for a file that does not validate but whose `[state]` section does, that section
    on built-in defaults for everything else, and the file's problem: enough to find and read the state (the
    commands that only read it, `App.state_only`). A file that cannot be read, whose `[state]` is itself bad, or
    that names an unknown top-level setting (a misspelt `[state]`?) raises its problem: where the state is would be
    a guess."""
    for path, must_exist in config_candidates(explicit):
        if path.exists() or must_exist:
            data = read_toml(path)
            try:
                cfg, problem = Config.model_validate({**data, "source": str(path)}), None
            except ValidationError as exc:
                problem = format_validation_error(exc, path, Config)
                # An unknown top-level name may be the state's own settings misspelt (`[stat]`) or misplaced: the
                # defaults would then open another, empty, state.
                stray = any(len(e["loc"]) == 1 and e["type"] == "extra_forbidden" for e in exc.errors())
                if stray:
                    raise problem from None
                try:
                    cfg = Config.model_validate({"state": data.get("state", {}), "source": str(path)})
                except ValidationError:
                    raise problem from None
            break
    else:
        cfg, problem = Config(), None
    if state_dir:
        # A relative --state-dir is the shell's: from the current directory, not the config file's.
        given = Path(state_dir).expanduser().absolute()
        cfg = cfg.model_copy(update={"state": cfg.state.model_copy(update={"dir": given})})
    return cfg, problem
