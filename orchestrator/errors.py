"""The CLI's two failure kinds: bad input (exit 2) and operational failure (exit 1).

Both carry one human line. Neither ever carries a secret: messages are built from field names and
environment-variable *names*, never from their values.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

# The instant messages and the README give as an example of a deadline: years ahead, so that one copied is not refused
# as past (one a few days ahead, 2026-12-01, had gone stale within the week), and within the 10 years a deadline may
# be ahead. tests/test_cli_queue.py holds it to a year ahead at least.
EXAMPLE_INSTANT = "2035-01-01T09:00:00Z"


class BurstctlError(Exception):
    exit_code = 1


class BadInput(BurstctlError):
    """Malformed config, job spec or arguments. Nothing has been changed when this is raised."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | Path | None = None, field: str | None = None):
        self.source = str(source) if source is not None else None
        self.field = field
        self.detail = message
        parts = []
        if self.source:
            parts.append(self.source)
        if field:
            parts.append(f"field '{field}'")
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)


    def in_file(self, source: str | Path) -> BadInput:
        """The same problem, attributed to the file it came from (when the raiser did not know it)."""
        return self if self.source else BadInput(self.detail, source=source, field=self.field)


# What the CLI says on stderr once a command has succeeded (`cli.main`): a note said before a bad input's one line
# would make it two.
NOTES: list[str] = []
# The config file's problem that a command reading only the state ran past (`App.state_only`): said in the line of
# any error the command ends in too, so that the typo is not lost behind "no job named x".
CONFIG_PROBLEMS: list[BadInput] = []


class OperationalError(BurstctlError):
    """Something outside the input went wrong (a provider, SSH, the disk)."""

    exit_code = 1


class FieldValueError(ValueError):
    """A model validator's complaint about one field. Pydantic places any error of a model validator at the model
    itself (the top level for a whole file); this one carries the field, relative to that model, to name instead."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# What a value of the wrong type should have been, by pydantic's error type (strict models: nothing is converted).
_EXPECTED_TYPE = {"float_type": "a number", "int_type": "an integer", "int_from_float": "an integer",
                  "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
                  "dict_type": "a table", "model_type": "a table", "model_attributes_type": "a table",
                  "datetime_type": "an ISO 8601 date and time", "path_type": "a path (a string)",
                  "time_type": "a time of day (a TOML time, 22:00:00)", "time_parsing": "a time of day (a TOML time, "
                  "22:00:00)"}


# A number out of its range, by pydantic's error type: its bound's name in the error's context, and the words.
_BOUND = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "greater than or equal to"),
          "less_than": ("lt", "less than"), "less_than_equal": ("le", "less than or equal to")}


def shown_count(n: int) -> str:
    """A whole number for a message: as it is, or, past 15 digits, its size (an error once printed 120 digits)."""
    digits = len(str(abs(n)))
    return str(n) if digits <= 15 else f"{'-' if n < 0 else ''}a {digits}-digit number"


def what_was_given(value: object) -> str:
    """The wrong value, shown only when it cannot be a secret (a boolean or a number); else only its kind."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    kinds = {str: "a string", list: "a list", dict: "a table"}
    return next((word for cls, word in kinds.items() if isinstance(value, cls)), f"a {type(value).__name__}")


# What a regex constraint means, in words, by its pattern (the models that use one register it): a pydantic message
# would show the regex.
PATTERN_WORDS: dict[str, str] = {}
_DATETIME_ERRORS = ("datetime_parsing", "datetime_from_date_parsing", "datetime_object_invalid")
SHOWN_ALSO = 3  # problems after the first named in the same line


def _fields_at(model: Any, loc: list[str]) -> list[str]:
    """The field names of the (nested) model at `loc` below `model`: where a mistyped field should have been."""
    for step in loc:
        if isinstance(model, dict):  # a table of models by name, or a list of them: the step is a key or an index
            model = model.get("value")
            continue
        fields = getattr(model, "model_fields", {})
        field = fields.get(step) or next((f for f in fields.values() if f.alias == step), None)
        if field is None:
            return []
        model = _model_in(field.annotation)
    return [f.alias or name for name, f in getattr(model, "model_fields", {}).items()]


def _model_in(annotation: Any) -> Any:
    """The model an annotation holds: itself, inside `X | None`, or the items of `dict[str, X]` or `list[X]` (as a
    marker: a step of the path is then a key or an index)."""
    if hasattr(annotation, "model_fields"):
        return annotation
    args: tuple[Any, ...] = tuple(getattr(annotation, "__args__", ()))
    origin = getattr(annotation, "__origin__", None)
    if (origin is dict and len(args) == 2) or (origin is list and len(args) == 1):
        inner = _model_in(args[-1])
        return {"value": inner} if inner is not None else None
    return next((m for m in (_model_in(a) for a in args) if m is not None), None)


def _one_problem(error: Any, model: Any) -> tuple[str, str]:
    """(field, what is expected) for one pydantic error."""
    path = [str(p) for p in error["loc"]]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, FieldValueError):
        path.append(cause.field)
    loc = ".".join(path) or "(top level)"
    kind = error["type"]
    msg = error["msg"]
    if kind == "missing":
        msg = "is required but missing"
    elif kind == "finite_number":
        msg = "expected a finite number, not inf or nan"
    elif kind == "value_error":
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix on a validator's own words
    elif kind in _BOUND:
        # "a number" for integer fields too: an integer is one, and a fraction given to one fails as int_from_float.
        bound = error.get("ctx", {}).get(_BOUND[kind][0])
        shown = f"{bound:g}" if isinstance(bound, int | float) else bound
        msg = f"expected a number {_BOUND[kind][1]} {shown}, got {what_was_given(error.get('input'))}"
    elif kind in _EXPECTED_TYPE:
        msg = f"expected {_EXPECTED_TYPE[kind]}, got {what_was_given(error.get('input'))}"
        if kind == "list_type" and len(path) == 1 and isinstance(error.get("input"), dict):
            msg += f" (a list of tables is written [[{path[0]}]], with two brackets)"
    elif kind in _DATETIME_ERRORS:
        msg = f"expected an ISO 8601 date and time with a time zone ({EXAMPLE_INSTANT})"
    elif kind == "literal_error":  # pydantic's "Input should be 'a' or 'b'", in this file's words
        # The value given is not repeated: a string here may be anything pasted, a secret too.
        msg = f"expected {error.get('ctx', {}).get('expected', 'one of its values')}, got " + (
            "another string" if isinstance(error.get("input"), str) else what_was_given(error.get("input")))
    elif kind == "string_too_short":
        msg = "expected some text, got an empty string" if error.get("ctx", {}).get("min_length") == 1 else \
            f"expected at least {error.get('ctx', {}).get('min_length')} characters"
    elif kind == "string_too_long":
        msg = f"expected at most {error.get('ctx', {}).get('max_length')} characters"
    elif kind == "string_pattern_mismatch":
        pattern = error.get("ctx", {}).get("pattern")
        msg = f"expected {PATTERN_WORDS.get(pattern, f'a string matching {pattern}')}"
    elif kind == "extra_forbidden":
        msg = "is not a known field"
        near = difflib.get_close_matches(path[-1], _fields_at(model, path[:-1]), n=1) if model is not None else []
        if near:
            msg += f" (did you mean '{near[0]}'?)"
        if any(s in loc.lower() for s in ("key", "secret", "token", "password")):
            msg += " (secrets are never written inline: name an environment variable in a '*_env' field)"
    return loc, msg


def format_validation_error(exc: Any, source: str | Path, model: Any = None) -> BadInput:
    """Turn a pydantic ValidationError into one BadInput line: file, field, what is expected; the next few problems
    after it, in the same line, so that a file with several is not fixed one run at a time. `model`: the model
    validated, whose field names suggest the one a mistyped field meant."""
    problems = [_one_problem(e, model) for e in exc.errors(include_url=False)]
    loc, msg = problems[0]
    also = [f"field '{other}': {what}" for other, what in problems[1:1 + SHOWN_ALSO]]
    more = len(problems) - 1 - len(also)
    if also:
        msg += f" (also {'; '.join(also)}{f'; and {more} more' if more else ''})"
    return BadInput(msg, source=source, field=loc)
