"""The job spec: a TOML file (or a few flags) describing one training job.

Every field is documented by its description; `burstctl enqueue` validates the whole file before anything is
written, so a bad spec never reaches the queue.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import posixpath
import re
import shlex
import time
from collections.abc import Iterable
from datetime import date, datetime
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from orchestrator.config import (
    ENV_NAME,
    NAME_EXPECTED,
    NAME_MAX,
    NAME_PATTERN,
    SECRET_SHAPED,
    JobKind,
    Market,
    PassedEnvName,
    read_toml,
)
from orchestrator.core.gates import MAX_DEADLINE_HOURS, MAX_DEADLINE_YEARS
from orchestrator.errors import (
    EXAMPLE_INSTANT,
    BadInput,
    FieldValueError,
    format_validation_error,
    what_was_given,
)

Method = Literal["full", "lora", "qlora"]
Dtype = Literal["fp32", "bf16", "fp16", "int8", "int4"]
Parallelism = Literal["ddp", "fsdp"]
Attention = Literal["sdpa", "eager"]

SHELL_OPERATORS = frozenset({"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"})  # what a shell reads
MAX_STOP_GRACE_S = 3600.0  # a trainer's last checkpoint: an hour is more than any disk needs for one
DEADLINE_EXPECTED = f"expected an ISO 8601 date and time with a time zone, e.g. {EXAMPLE_INSTANT}"
DEADLINE_HOURS_EXPECTED = (f"expected a finite number of hours greater than 0 and at most {MAX_DEADLINE_HOURS:.0f} "
                           f"({MAX_DEADLINE_YEARS} years)")
JOB_ID = re.compile(r"j[0-9a-f]{8}")  # `queue.new_job_id`'s shape
# Variables burstctl itself gives the command (the supervisor's contract, and the runbooks' PYTHONPATH): a value
# passed under one of these names would be silently replaced, so the name is refused instead.
RESERVED_ENV = frozenset({"BURST_JOB_ID", "BURST_ATTEMPT", "BURST_CHECKPOINT_DIR", "BURST_RESUME_FROM",
                          "BURST_METRICS_FILE", "BURST_WORK_UNITS", "PYTHONPATH"})


class ModelSpec(BaseModel):
    """Sizing inputs; gate 1 is derived from them instead of a hand-given local throughput of 0."""

    # TOML spells inf and nan; no float of a job means either, and an infinite one crashes the arithmetic later.
    # Strict: a value of the wrong TOML type is refused, not converted (`deadline_hours = true` is not 1 h,
    # `resumable = "no"` is not false); an integer still counts as a number of hours or units.
    # Each number has a ceiling far above any model (100 T parameters, a 100 M context): past it is a slip, whose
    # estimate would be hundreds of digits of GB, or inf (`Infinity` in --json, which is not JSON).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    preset: str | None = Field(None, description="Known architecture, e.g. qwen2.5-7b, llama-3.1-8b.")
    params: Annotated[float, Field(gt=0, le=1e14)] | None = Field(None, description="Parameter count, if no preset.")
    layers: Annotated[int, Field(gt=0, le=10_000)] | None = Field(None, description="Transformer layers.")
    hidden_size: Annotated[int, Field(gt=0, le=1_000_000)] | None = Field(None, description="Model width.")
    attention_heads: Annotated[int, Field(gt=0, le=100_000)] | None = Field(None, description="Query heads.")
    kv_heads: Annotated[int, Field(gt=0, le=100_000)] | None = Field(
        None, description="KV heads (grouped-query attention).")
    head_dim: Annotated[int, Field(gt=0, le=100_000)] | None = Field(None, description="Dimension per head.")
    intermediate_size: Annotated[int, Field(gt=0, le=10_000_000)] | None = Field(None, description="MLP width.")
    vocab_size: Annotated[int, Field(gt=0, le=100_000_000)] | None = Field(
        None, description="Vocabulary (sizes the output logits).")
    method: Method = Field("full", description="full | lora | qlora.")
    dtype: Dtype = Field("bf16", description="Weights dtype (qlora implies 4-bit base weights).")
    lora_rank: Annotated[int, Field(gt=0, le=100_000)] = Field(16, description="LoRA rank r.")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Matrices that get adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj).",
    )
    group_size: Annotated[int, Field(ge=0, le=100_000)] = Field(0, description="GRPO group size G (0 = not GRPO).")
    prompts_per_step: Annotated[int, Field(ge=0, le=1_000_000)] = Field(0, description="GRPO prompts per step.")
    context: Annotated[int, Field(gt=0, le=100_000_000)] = Field(
        2048, description="Sequence / rollout context length.")
    micro_batch: Annotated[int, Field(gt=0, le=1_000_000)] = Field(1, description="Micro-batch size per GPU.")
    parallelism: Parallelism = Field("ddp", description="ddp (everything replicated) | fsdp (sharded).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in the backward pass.")
    attention: Attention = Field(
        "sdpa", description="sdpa (also flash attention: no context × context scores kept) | eager (transformers' "
                            "attn_implementation='eager': each layer keeps its softmax, heads × context² a sequence).")
    padding_mask: bool = Field(
        False, description="Sequences padded to a common length under an attention mask (micro_batch > 1, not "
                           "packed): k/v are repeated to the query heads and each layer keeps a context² mask.")
    mixed_precision: bool = Field(
        True, description="Full fine-tuning in bf16/fp16: an fp32 master copy of the weights and fp32 Adam moments "
                          "beside them (PyTorch AMP, transformers' Trainer with bf16=True: 16 B/param). false: trained "
                          "in the dtype itself, Adam's moments in it too (a model loaded in bf16 and trained as is: "
                          "8 B/param).")
    double_quant: bool = Field(
        False, description="4-bit base weights (qlora, int4) with bitsandbytes' double quantization "
                           "(BitsAndBytesConfig(bnb_4bit_use_double_quant=True), as the QLoRA paper trains): 0.516 "
                           "B/param instead of 0.5625. false is transformers' default.")


class CheckpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    dir: str = Field(
        "checkpoints", description="A directory in the workdir kept out of the push to an instance (e.g. where a "
                                   "run outside burstctl left its checkpoints), relative to workdir. The trainer "
                                   "writes its checkpoints to $BURST_CHECKPOINT_DIR, which burstctl gives it and "
                                   "syncs; not to this.")

    @field_validator("dir")
    @classmethod
    def _inside_workdir(cls, v: str) -> str:
        if not v or v.startswith(("/", "~")) or posixpath.normpath(v) == "." or _climbs_out(v):
            raise ValueError("expected a directory inside the workdir, relative to it (e.g. \"checkpoints\")")
        return v
    interval_minutes: Annotated[float, Field(gt=0)] = Field(30.0, description="How often the job checkpoints.")
    resumable: bool = Field(True, description="The trainer writes checkpoints and resumes from $BURST_RESUME_FROM "
                            "(true unless said, once the table is there). "
                            "false: a stop loses all its work, so it gets no hybrid plan (nothing to hand over), spot "
                            "is priced with each preemption restarting it from the start, and a running attempt is "
                            "never moved between markets.")
    stop_grace_s: Annotated[float, Field(gt=0, le=MAX_STOP_GRACE_S)] = Field(
        30.0, description="Seconds the trainer has for its last checkpoint once it is told to stop (SIGTERM, from a "
                          "stop, a hand-over, the local hours' end, max_run_hours or a spot notice) before it is "
                          f"killed (SIGKILL); at most {MAX_STOP_GRACE_S:.0f}. Give it the time the trainer takes to "
                          "write a checkpoint with its optimizer state (a 7B model's full fine-tune writes about "
                          "100 GB). The daemon waits for the run's end this long and a margin (30 s on an instance, "
                          "10 s on this machine) before it brings the newest checkpoint home and ends the instance. "
                          "On spot the grace cannot outlast the reclaim: EC2 takes the instance about 120 s after its "
                          "interruption notice whatever the grace, so a trainer that needs longer loses what it has "
                          "not written by then and resumes from its newest complete checkpoint: checkpoint more "
                          "often (interval_minutes), or run it on-demand.")


def _is_date(text: str) -> bool:
    """Whether `text` is a calendar date alone, as pydantic reads one for a date and time (YYYY-MM-DD)."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        return False
    try:
        date.fromisoformat(text)
    except ValueError:  # 2026-13-45: not a date, said as any text that is not an instant is
        return False
    return True


def _not_a_bare_instant(v: object, alternative: str = "") -> object:
    """An instant as given, before it is parsed (a deadline, `confirm-gone --at`): not a number or a date alone.
    `alternative`: what else the user may give, said after what is expected."""
    # pydantic would read seconds since 1970, of a number and of a string of digits ("20261207") alike
    numeric = isinstance(v, int | float) and not isinstance(v, bool)
    if numeric or (isinstance(v, str) and re.fullmatch(r"\s*[-+]?\d+(\.\d*)?\s*", v)):
        raise ValueError(f"is a number: {DEADLINE_EXPECTED}{alternative}")
    # TOML's `deadline = 2026-12-03` is a date, which pydantic would take as a naive midnight; so is the string
    # "2026-12-03", which had been said to have no time zone.
    if (isinstance(v, date) and not isinstance(v, datetime)) or (isinstance(v, str) and _is_date(v)):
        raise ValueError(f"is a date without a time: {DEADLINE_EXPECTED}")
    return v


def _zoned_instant(v: datetime | None) -> datetime | None:
    if v is not None and v.tzinfo is None:
        raise ValueError(f"has no time zone: {DEADLINE_EXPECTED}")
    return v


def parse_instant(text: str) -> datetime:
    """An instant given on the command line, in the forms a job file's `deadline` takes (ISO 8601 with a time zone,
    `2035-01-01T09:00:00Z`, `2035-01-01 10:00+01:00`). Raises ValueError saying what is expected (not quoting
    `text`, which may be anything pasted)."""
    _not_a_bare_instant(text)
    try:
        when = TypeAdapter(datetime).validate_python(text.strip())  # lax, as the `deadline` field reads a string
    except ValidationError:
        raise ValueError(f"is not a date and time: {DEADLINE_EXPECTED}") from None
    zoned = _zoned_instant(when)
    assert zoned is not None
    return zoned


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)  # as ModelSpec

    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)] = Field(
        description=f"Job name: {NAME_EXPECTED}."
    )
    kind: JobKind = Field("train", description="train | eval | embed | serve.")
    command: list[str] = Field(description="The command, as an argument list (a string is split shell-style).")
    setup: list[str] = Field(
        default_factory=list,
        description="Run once on each rented instance, after the workdir is pushed and before the command, in the "
                    "workdir with the job's environment (e.g. \"pip install -r requirements.txt\"; a string is split "
                    "shell-style). Not run locally: this machine is set up already. It must be safe to run again on "
                    "a fresh instance. A successor launched at a spot notice runs it while its predecessor still "
                    "trains. A setup that still fails after `setup_retries` fails the attempt with its last line of "
                    "output.")
    outputs: list[str] = Field(
        default_factory=list,
        description="What the job writes in its workdir besides checkpoints that is its result: paths or globs "
                    "relative to the workdir (\"result.json\", \"eval/*.json\"; a directory brings everything under "
                    "it), those the run wrote (not a file an earlier run left in the workdir), copied into "
                    "<state>/outputs/<job>/ when it finishes: from a rented instance before it is "
                    "terminated, from the workdir when it finished on this machine (which keeps its own). On a rented "
                    "instance they also come home with each checkpoint, so a preempted attempt's files (a "
                    "TensorBoard events file per run) are not lost with it.")
    exclude: list[str] = Field(
        default_factory=list,
        description="What the push to a rented instance leaves out of the workdir, besides .git, __pycache__, "
                    "*.pyc, .venv and checkpoint.dir: rsync's exclude patterns, relative to the workdir (\"data/\", "
                    "\"wandb/\", \"*.ckpt\"). As in a .gitignore, a pattern with no '/' but a trailing one matches "
                    "a name at any depth (\"*.ckpt\", \"wandb/\"), and one with a '/' before its end is a path from "
                    "the workdir (\"data/raw/\", \"logs/*.txt\"), unless it begins with '**' (\"**/cache/\": at "
                    "any depth); a trailing '/' matches directories only; '*' and '?' stop at '/', '**' does not; "
                    "[...] is a class. Nothing under a directory left out is pushed. rsync and the SFTP fallback "
                    "leave out the same files. Not for what the command needs: a pattern that leaves out its "
                    "script is refused.")
    setup_retries: Annotated[int, Field(ge=0, le=10)] = Field(
        2, description="How many times a failed setup runs again on the same instance, after 10 s, then 20 s, 40 s "
                       "…, before the attempt fails: a network blip in a pip install passes, a missing package "
                       "costs a few seconds of the instance's time. 0 to fail at once.")
    workdir: str = Field(".", description="Directory pushed to the instance, relative to the spec file; the command "
                                          "runs in it, and a relative path it names must not climb out of it.")
    deadline: datetime | None = Field(None, strict=False,  # TOML's own date-time, or the same in a string
                                      description="ISO 8601 instant by which the job must be done.")
    deadline_hours: Annotated[float, Field(gt=0)] | None = Field(
        None, description=f"Or: hours from now (at most {MAX_DEADLINE_HOURS:.0f}, {MAX_DEADLINE_YEARS} years)."
    )
    work_units: Annotated[float, Field(gt=0)] = Field(1.0, description="W: work in units (1 = the whole job).")
    local_throughput: Annotated[float, Field(ge=0)] = Field(
        description="s_L: units/h on the local GPU; 0 = does not fit."
    )
    rented_throughput: dict[str, Annotated[float, Field(gt=0)]] = Field(
        description="s_R per GPU type: units/h per GPU, e.g. {H100 = 0.17}."
    )
    gpus: Annotated[int, Field(ge=1, le=64)] = Field(1, description="g: GPUs to rent.")
    market: Market | None = Field(None, description="auto | spot | on-demand; default from config.")
    deadline_critical: bool = Field(False, description="This run's completion is critical: on-demand, no spot.")
    torchrun: bool = Field(False, description="Launch with torchrun --standalone --nproc_per_node=g (locally g=1).")
    max_run_hours: Annotated[float, Field(gt=0)] | None = Field(None, description="Guard: stop after this long.")
    checkpoint: CheckpointSpec = Field(
        default_factory=lambda: CheckpointSpec(resumable=False),
        description="How the trainer checkpoints. Without this table the job is taken as one that does not "
                    "(`resumable = false`): a trainer that never heard of $BURST_CHECKPOINT_DIR would lose its work at "
                    "each preemption, hand-over or pause that a plan for a checkpointing job takes for granted.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for the command. Stored in plain text (database, `show --json`): not for "
                    "secrets; use pass_env.")
    pass_env: list[PassedEnvName] = Field(
        default_factory=list,
        description="Names of environment variables of the daemon's own environment whose values the command gets "
                    "when it starts, locally and on an instance (e.g. [\"WANDB_API_KEY\", \"HF_TOKEN\"]): for secrets. "
                    "Only the names are stored; a name the daemon does not have keeps the job waiting, saying which.")
    model: ModelSpec | None = Field(None, description="Sizing inputs for gate 1.")

    @field_validator("deadline_hours", mode="before")
    @classmethod
    def _finite_hours(cls, v: object) -> object:
        # Before pydantic's own check, so inf and nan get the same words as a deadline beyond the cap.
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(DEADLINE_HOURS_EXPECTED)
        return v

    @field_validator("workdir")
    @classmethod
    def _a_directory(cls, v: str) -> str:
        if not v.strip():  # Path("") would be the job file's directory: "." says so, "" is more likely a slip
            raise ValueError("is empty: expected a directory relative to the job file (\".\" for the file's own)")
        return v

    @field_validator("name")
    @classmethod
    def _not_an_id(cls, v: str) -> str:
        # Commands take a job by id or by name: a name shaped like an id would be taken for another job's.
        if JOB_ID.fullmatch(v):
            raise ValueError(f"'{v}' has the shape of a job id (j and 8 hex digits), which commands would take for "
                             "another job's: expected a name that says what the job is")
        return v

    @field_validator("deadline", mode="before")
    @classmethod
    def _not_a_bare_date(cls, v: object) -> object:
        return _not_a_bare_instant(v, " (or deadline_hours for hours from now)")

    @field_validator("deadline")
    @classmethod
    def _zoned(cls, v: datetime | None) -> datetime | None:
        return _zoned_instant(v)

    @field_validator("command", "setup", mode="before")
    @classmethod
    def _split(cls, v: object, info: ValidationInfo) -> object:
        if isinstance(v, str):
            try:
                words = shlex.split(v)
            except ValueError as exc:  # shlex's own words ("No closing quotation") say nothing of what to write
                raise ValueError(f"cannot be split into arguments ({str(exc).lower()}): expected every quote closed, "
                                 "or a list of arguments ([\"python3\", \"train.py\"])") from None
            shell = next((w for w in words if w in SHELL_OPERATORS), None)
            if shell is not None:
                # Found only when it runs: `python3 train.py | tee log` fails with "unrecognized arguments: | tee".
                raise ValueError(f"'{v}' is split into arguments and run without a shell, so '{shell}' would reach "
                                 f"the program as an argument: to use a shell, write [\"sh\", \"-c\", {json.dumps(v)}]")
            return words
        if not isinstance(v, list):  # pydantic would say "expected a list", though one string is as good
            raise ValueError(f"expected a list of strings or one string, got {what_was_given(v)}")
        return v

    @field_validator("outputs")
    @classmethod
    def _inside_the_workdir(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.strip() or path.startswith(("/", "~")) or ".." in PurePosixPath(path).parts:
                raise ValueError(f"'{path}' is not inside the workdir: expected a path or glob relative to it, "
                                 "e.g. \"result.json\" or \"eval/*.json\"")
        return v

    @field_validator("exclude")
    @classmethod
    def _exclude_patterns(cls, v: list[str]) -> list[str]:
        for pattern in v:
            problem = _exclude_problem(pattern)
            if problem is not None:
                raise ValueError(problem)
        return v

    @field_validator("command")
    @classmethod
    def _nonempty(cls, v: list[str]) -> list[str]:
        if not v or not v[0].strip():
            raise ValueError("must not be empty: expected the program and its arguments, e.g. "
                             "[\"python3\", \"train.py\"]")
        if len(v) == 1 and len(words := v[0].split()) > 1:  # found only when it runs: "no such file" (code 127)
            raise ValueError(f"'{v[0]}' is one argument, run as a program of that name: write "
                             f"{json.dumps(words)}, or the whole command as one string")
        return v

    @field_validator("command", "setup")
    @classmethod
    def _no_nul(cls, v: list[str]) -> list[str]:
        # No program can be given one: it failed at its start, after a rented instance had booted.
        if any("\0" in word for word in v):
            raise ValueError("holds a NUL character: no program's argument can")
        return v

    @field_validator("rented_throughput")
    @classmethod
    def _some_rented(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("name at least one GPU type with its units/h per GPU, e.g. {H100 = 0.17}")
        return v

    @field_validator("env")
    @classmethod
    def _settable(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"'{name}' is not a variable name: expected letters, digits and '_', not starting "
                                 "with a digit")
            if "\0" in value or "\n" in value or "\r" in value:
                # The job's environment is handed over a line a variable: a line break would end the value there
                # and start another variable (one the job contract reserves, even), and a NUL no process takes.
                raise ValueError(f"'{name}' holds a {'NUL character' if chr(0) in value else 'line break'}: "
                                 "expected one line of text")
            if name in RESERVED_ENV:
                raise ValueError(f"'{name}' is set by burstctl for every job (the job contract) and cannot be set "
                                 "here: it would be replaced")
        return v

    @field_validator("pass_env")
    @classmethod
    def _passable(cls, v: list[str]) -> list[str]:
        for name in v:
            if name in RESERVED_ENV:
                raise ValueError(f"'{name}' is set by burstctl for every job and cannot be passed")
        return list(dict.fromkeys(v))  # a name listed twice is the same variable

    @model_validator(mode="after")
    def _env_or_passed(self) -> JobSpec:
        both = sorted(set(self.env) & set(self.pass_env))
        if both:
            raise FieldValueError("pass_env", f"'{both[0]}' is also in [env]: give a variable in one of them only")
        return self

    @model_validator(mode="after")
    def _one_deadline(self) -> JobSpec:
        if self.deadline is not None and self.deadline_hours is not None:
            raise FieldValueError("deadline_hours", "cannot be given with 'deadline': give exactly one of them")
        if self.deadline is None and self.deadline_hours is None:
            raise FieldValueError("deadline", "is missing: give 'deadline', an ISO 8601 date and time with a time zone "
                                              f"({EXAMPLE_INSTANT}), or 'deadline_hours', hours from now")
        return self

    def deadline_at(self, now: float) -> float:
        if self.deadline is not None:
            return self.deadline.timestamp()
        assert self.deadline_hours is not None
        return now + self.deadline_hours * 3600.0


# The names a secret goes by (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD), as whole words between
# '_': not TOKENIZERS_PARALLELISM or MAX_TOKENS.
_SECRET_NAME = re.compile(r"(^|_)(SECRET|PASSWORD|PASSWD)(_|$)|(^|_)TOKEN$|(^|_)(API|ACCESS|PRIVATE|SECRET)_?KEY$",
                          re.IGNORECASE)


def _looks_secret(name: str, value: str) -> bool:
    """An [env] entry that is a secret: a secret's name, or a value shaped like an API key or token."""
    return _SECRET_NAME.search(name) is not None or SECRET_SHAPED.match(value) is not None


def too_much_work(work: float, rates: Iterable[float]) -> str | None:
    """Why no GPU given finishes `work` units within the longest deadline there is (10 years), or None. Such a job
    can meet no deadline, and its hours overflow every figure printed for it."""
    best = max((r for r in rates if r > 0), default=0.0)
    hours = work / best if best > 0 else math.inf
    if hours <= MAX_DEADLINE_HOURS:
        return None
    took = f"{hours:.3g} h" if math.isfinite(hours) else "beyond any number of hours"
    return (f"{work:g} units take {took} at the fastest rate given ({best:g} units/h, the rented ones × gpus); "
            f"expected work some GPU finishes within {MAX_DEADLINE_YEARS} years ({MAX_DEADLINE_HOURS:.0f} h), the "
            "longest deadline")


def too_slow(work: float, rate: float, gpus: int = 1, *, local: bool = False) -> str | None:
    """Why a throughput given for one GPU type (`rate` units/h per GPU, `gpus` of them) is no figure of a GPU, or
    None: at it, `work` would take longer than the longest deadline there is (10 years). Such a GPU meets no
    deadline, and its hours and dollars overflow every figure printed for it (a local_throughput of 1e-300 gave
    300-digit costs). The local GPU's 0 means the job does not fit there, never too slow."""
    total = rate * gpus
    if rate <= 0 or work / total <= MAX_DEADLINE_HOURS:
        return None
    hours = work / total
    took = f"{hours:.3g} h" if math.isfinite(hours) else "beyond any number of hours"
    per = "" if local else " per GPU"
    on = f" on {gpus} GPUs" if gpus > 1 else ""
    return (f"{work:g} units take {took} at {rate:g} units/h{per}{on}; expected at least "
            f"{work / MAX_DEADLINE_HOURS / gpus:.3g} units/h{per}, which finishes them within {MAX_DEADLINE_YEARS} "
            f"years ({MAX_DEADLINE_HOURS:.0f} h), the longest deadline"
            + (", or 0 if the job does not fit on the local GPU" if local else ""))


def load_job(path: str | Path, now: float | None = None) -> tuple[JobSpec, float]:
    """Parse and validate a job file; returns the spec and its absolute deadline (unix seconds)."""
    path = Path(path)
    data = read_toml(path)
    now = time.time() if now is None else now
    # Before the names are validated: a pasted token that is also a valid name (or shaped like one) is told as
    # what it is.
    given = data.get("pass_env")
    passed: list[object] = given if isinstance(given, list) else []
    values = set(os.environ.values())
    pasted = [i for i, name in enumerate(passed) if isinstance(name, str) and len(name) >= 8 and name in values]
    if pasted:
        # The value of one of the user's variables where its name belongs (a pasted token): never quoted back.
        raise BadInput("is the value of an environment variable of this shell, not its name; expected the NAME "
                       "(e.g. HF_TOKEN), never the secret itself", source=path, field=f"pass_env.{pasted[0]}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, path, JobSpec) from None
    # At intake only, not in the model: a job stored before this check was added must still load.
    secret = next((name for name, value in spec.env.items() if value and _looks_secret(name, value)), None)
    if secret is not None:
        # [env] is kept in plain text (the database, `show --json`, the run's env file): never quoted back.
        raise BadInput(f"'{secret}' looks like a secret (by its name or its value's shape), and [env] is stored in "
                       "plain text: name the variable in pass_env instead, with its value in the daemon's "
                       "environment", source=path, field=f"env.{secret}")
    # A ceiling no job has: past it a figure is a slip (1e308), which made the decision's spot figures 300 digits long.
    if spec.checkpoint.interval_minutes > MAX_DEADLINE_HOURS * 60:
        raise BadInput(f"{spec.checkpoint.interval_minutes:g} is more than {MAX_DEADLINE_HOURS * 60:.0f}: expected the "
                       f"minutes between checkpoints, at most {MAX_DEADLINE_YEARS} years", source=path,
                       field="checkpoint.interval_minutes")
    if spec.max_run_hours is not None and spec.max_run_hours > MAX_DEADLINE_HOURS:
        raise BadInput(f"{spec.max_run_hours:g} is more than {MAX_DEADLINE_HOURS:.0f}: expected hours, at most "
                       f"{MAX_DEADLINE_YEARS} years (leave it out for no limit)", source=path, field="max_run_hours")
    why = too_much_work(spec.work_units, [spec.local_throughput, *(s_r * spec.gpus
                                                                   for s_r in spec.rented_throughput.values())])
    if why:
        raise BadInput(why, source=path, field="work_units")
    why = too_slow(spec.work_units, spec.local_throughput, local=True)
    if why:
        raise BadInput(why, source=path, field="local_throughput")
    for gpu, s_r in spec.rented_throughput.items():
        why = too_slow(spec.work_units, s_r, spec.gpus)
        if why:
            raise BadInput(why, source=path, field=f"rented_throughput.{gpu}")
    deadline_at = spec.deadline_at(now)
    if deadline_at <= now:
        if spec.deadline is None:  # hours so few that they round to now
            raise BadInput(f"is {spec.deadline_hours!r} hours, which is now; expected the hours from now the job has "
                           "(e.g. 12)", source=path, field="deadline_hours")
        # The file's own instant: a year-1 deadline is past but not a timestamp datetime can hold.
        raise BadInput(f"is in the past ({spec.deadline.isoformat()}); expected a future instant", source=path,
                       field="deadline")
    if deadline_at - now > MAX_DEADLINE_HOURS * 3600.0:
        if spec.deadline is not None:
            raise BadInput(f"is more than {MAX_DEADLINE_YEARS} years ahead ({spec.deadline.isoformat()}); expected "
                           f"an instant within {MAX_DEADLINE_YEARS} years", source=path, field="deadline")
        raise BadInput(DEADLINE_HOURS_EXPECTED, source=path, field="deadline_hours")
    workdir = Path(path.parent, spec.workdir)
    if not workdir.is_dir():
        raise BadInput(f"'{spec.workdir}' is a file; expected the directory the command runs in" if workdir.exists()
                       else f"directory '{spec.workdir}' does not exist", source=path, field="workdir")
    too_wide = _holds_home(workdir)
    if too_wide:
        raise BadInput(f"'{spec.workdir}' is {too_wide}, and the whole workdir is copied to a rented instance (~/.ssh "
                       "and ~/.aws too); expected the project's own directory", source=path, field="workdir")
    outside = next((i for i, arg in enumerate(spec.command) if _leaves_workdir(arg)), None)
    if outside is not None:
        # The command runs in the workdir, locally and on an instance, and only the workdir is copied there.
        raise BadInput(f"'{spec.command[outside]}' is outside the workdir '{spec.workdir}', and only the workdir is "
                       "copied to a rented instance; expected a path inside it (set workdir to a directory that "
                       "holds it)", source=path, field=f"command.{outside}")
    for field, argv in (("command", spec.command), ("setup", spec.setup)):
        at = _shell_word(argv)
        if at is not None:
            raise BadInput(_shell_word_problem(argv[at]), source=path, field=f"{field}.{at}")
    absolute = _absolute_script(spec.command, spec.torchrun) if not spec.setup else None  # a setup may put it there
    if absolute is not None:
        # Found out on a rented instance, it costs a billing minimum and a boot to say so.
        at, given = absolute
        inside = Path(given).resolve().is_relative_to(workdir.resolve())
        hint = (f"'{Path(given).resolve().relative_to(workdir.resolve())}'" if inside
                else "a path relative to the workdir (set workdir to a directory that holds it)")
        raise BadInput(f"'{given}' is an absolute path, and only the workdir is copied to a rented instance, "
                       f"where it would not be; expected {hint}", source=path, field=f"command.{at}")
    missing = _missing_script(spec.command, workdir) if not spec.setup else None  # a setup may fetch it
    if missing is not None:
        # Found out on a rented instance, it costs a billing minimum and a boot to say so.
        near = difflib.get_close_matches(missing, [p.name for p in (workdir / missing).parent.glob("*")], n=1)
        raise BadInput(f"'{missing}' is not in the workdir '{spec.workdir}'"
                       + (f" (did you mean '{near[0]}'?)" if near else "")
                       + f"; expected the path of the script {Path(spec.command[0]).name} runs, relative to it",
                       source=path, field="command.1")
    script = _script_run(spec.command, spec.torchrun) if spec.exclude and not spec.setup else None
    hit = next((i for i, p in enumerate(spec.exclude) if script and _leaves_out(p, script)), None)
    if hit is not None:
        # Found out on a rented instance, it costs a billing minimum and a boot to say so.
        raise BadInput(f"'{spec.exclude[hit]}' leaves '{script}', the script the command runs, out of the push to an "
                       "instance, which would not have it; expected patterns that keep it", source=path,
                       field=f"exclude.{hit}")
    return spec, deadline_at


SCRIPT_RUNNERS = re.compile(r"python[0-9.]*|bash|sh")  # programs whose first argument (not an option) is a file


def _missing_script(command: list[str], workdir: Path) -> str | None:
    """The script a `python3 train.py` (or bash, sh) command names, when the workdir has no such file."""
    if len(command) < 2 or not SCRIPT_RUNNERS.fullmatch(Path(command[0]).name) or command[1].startswith("-"):
        return None
    script = command[1]
    if script.startswith(("/", "~", "$")) or (workdir / script).exists():
        return None
    return script


def _absolute_script(command: list[str], torchrun: bool) -> tuple[int, str] | None:
    """The index and path of the script the command runs (as `_script_run` finds it) when that is absolute."""
    at = 0 if torchrun else 1
    if (len(command) > at and command[at].startswith("/")
            and (torchrun or SCRIPT_RUNNERS.fullmatch(Path(command[0]).name))):
        return at, command[at]
    return None


# What only a shell expands: an environment variable by the convention of capitals ($HF_HOME, ${BURST_JOB_ID})
# or any name in braces, and a leading ~. A command runs without a shell, so its program gets them as written.
SHELL_WORD = re.compile(r"\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|\$(?P<name>[A-Z_][A-Z0-9_]*)\b|^~(?=/|$)")
SHELLS = re.compile(r"(ba|da|z|k)?sh")


def _shell_word(argv: list[str]) -> int | None:
    """The index of the first argument holding a word only a shell would expand. None for a shell given a script
    to run (`sh -c "..."`), whose script expands its own."""
    if argv and SHELLS.fullmatch(Path(argv[0]).name) and any(
            re.fullmatch(r"-[A-Za-z]*c[A-Za-z]*", a) for a in argv[1:]):
        return None
    return next((i for i, arg in enumerate(argv) if SHELL_WORD.search(arg)), None)


def _shell_word_problem(arg: str) -> str:
    found = SHELL_WORD.search(arg)
    assert found is not None
    if found.group(0).startswith("~"):
        return (f"'{arg}' reaches the program as written: it runs without a shell, so '~' is not your home "
                "directory; expected a path relative to the workdir")
    name = found.group("braced") or found.group("name")
    return (f"'{arg}' reaches the program as written: it runs without a shell, so ${name} is not expanded; "
            f"expected the program to read the variable itself (os.environ[\"{name}\"]), or a shell to expand "
            f"it: [\"sh\", \"-c\", \"...\"]")


def _script_run(command: list[str], torchrun: bool) -> str | None:
    """The file of the workdir the command runs, normalized: torchrun's script (the command's first word), or the
    script python, bash or sh are given. None when it names none, or one outside the workdir."""
    if torchrun:
        script = command[0]
    elif len(command) >= 2 and SCRIPT_RUNNERS.fullmatch(Path(command[0]).name):
        script = command[1]
    else:
        return None
    if script.startswith(("-", "/", "~", "$")) or _climbs_out(script):
        return None
    return posixpath.normpath(script)


def rsync_exclude(pattern: str) -> str:
    """A job's `exclude` pattern as rsync's --exclude reads it. One with a '/' before its end is a path from the
    workdir (a .gitignore's rule), which rsync would match at any depth: it is anchored with a leading '/', unless it
    begins with '**' (rsync then matches it at any depth, the top included, as a .gitignore does). Others as given."""
    return f"/{pattern}" if "/" in pattern.rstrip("/") and not pattern.startswith("**") else pattern


def _exclude_problem(pattern: str) -> str | None:
    """Why an `exclude` pattern is refused, or None."""
    from orchestrator.remote.sync import compile_excludes  # paramiko's import: only for a job that has patterns

    example = "expected a pattern relative to the workdir, e.g. \"data/\" or \"*.ckpt\""
    parts = (pattern[:-1] if pattern.endswith("/") else pattern).split("/")
    if not pattern.strip():
        return f"an empty pattern leaves nothing out: {example}"
    if pattern.startswith(("/", "~")):
        return (f"'{pattern}' is not relative to the workdir: {example} (a '/' inside a pattern, \"data/raw/\", "
                "makes it a path from the workdir)")
    if ".." in parts:
        return f"'{pattern}' climbs out of the workdir with '..', and only the workdir is pushed: {example}"
    if "" in parts or "." in parts:
        return f"'{pattern}' has an empty or '.' part, which no path in the workdir has: {example}"
    if pattern.startswith(("+ ", "- ")) or pattern == "!":
        return f"'{pattern}' would be read by rsync as a filter rule ('+ ', '- ', '!'), not a pattern: {example}"
    try:
        compile_excludes([pattern])
    except ValueError as exc:
        return f"{exc}: {example}"
    return None


def _leaves_out(pattern: str, script: str) -> bool:
    from orchestrator.remote.sync import left_out

    return left_out(script, [rsync_exclude(pattern)])


def _holds_home(workdir: Path) -> str | None:
    """What a workdir is if it is the home directory, the filesystem's root or another directory holding the home
    (its keys and credentials would go to every instance the job runs on), else None."""
    where = workdir.resolve()
    try:
        home = Path.home().resolve()
    except (KeyError, RuntimeError):  # no home known: only the root is certain to hold everything
        home = Path(where.anchor)
    if where == home:
        return "your home directory"
    if where == Path(where.anchor):
        return "the filesystem's root"
    return f"a directory that holds your home directory ({home})" if home.is_relative_to(where) else None


def _leaves_workdir(arg: str) -> bool:
    """A relative path argument that climbs out of the directory it is run in (`../train.py`, `a/../../x`)."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    if not value or value.startswith(("/", "~")) or ("/" not in value and value != ".."):
        return False  # not a relative path (a word, a flag, an absolute path)
    return _climbs_out(value)


def _climbs_out(relative: str) -> bool:
    """Whether a relative path, once `..` cancels what it can, leads out of where it starts."""
    norm = posixpath.normpath(relative)
    return norm == ".." or norm.startswith("../")
