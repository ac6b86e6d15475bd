"""The batch lane's pure parts: job states and moves, the OpenAI Batch and File objects, the
input file's checks and the output and error files' lines. No I/O, no clock: times come in.

The states are OpenAI's: ``validating -> in_progress -> finalizing -> completed | expired``,
``cancelling -> cancelled`` from validating or in_progress, ``failed`` when validation fails.
A job's ``ending`` says which end its finalizing leads to (completed or expired).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# The endpoints a batch may call: the two the router serves.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# The only window OpenAI's API accepts; how long it really lasts is batch.window_s.
COMPLETION_WINDOW = "24h"
MAX_CUSTOM_ID = 512
MAX_METADATA_KEYS = 16


class Status(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED})
MOVES: dict[Status, frozenset[Status]] = {
    Status.VALIDATING: frozenset({Status.IN_PROGRESS, Status.FAILED, Status.CANCELLING}),
    Status.IN_PROGRESS: frozenset({Status.FINALIZING, Status.CANCELLING}),
    Status.FINALIZING: frozenset({Status.COMPLETED, Status.EXPIRED}),
    Status.CANCELLING: frozenset({Status.CANCELLED}),
}
# Which states a move may start from: the store's conditional update uses these.
CANCELLABLE = (Status.VALIDATING, Status.IN_PROGRESS)


def may_move(current: Status, to: Status) -> bool:
    return to in MOVES.get(current, frozenset())


def final_status(status: Status, ending: str | None) -> Status | None:
    """Where a job that is winding down ends: None for a job that is not winding down."""
    if status == Status.CANCELLING:
        return Status.CANCELLED
    if status == Status.FINALIZING:
        return Status.EXPIRED if ending == Status.EXPIRED else Status.COMPLETED
    return None


def skipped_code(final: Status) -> str:
    """The error code of a line that never ran, in the error file of a job that ended so."""
    return "batch_expired" if final == Status.EXPIRED else "batch_cancelled"


@dataclass(slots=True)
class Job:
    """One batch, as stored; counts are filled in from its lines when read."""

    id: str
    endpoint: str
    input_file_id: str
    created_at: float
    expires_at: float
    tenant: str
    status: Status = Status.VALIDATING
    ending: str | None = None
    times: dict[str, float] = field(default_factory=dict)  # "<status>_at" -> when
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0  # lines with a 2xx answer stored
    failed: int = 0  # lines with an error stored (and, once ended, lines that never ran)
    pending: int = 0  # lines waiting to run
    running: int = 0  # lines claimed by some router right now
    skipped: int = 0  # of ``failed``: lines that never ran (the job ended first)
    seq: int = 0  # creation order, for listing

    def to_openai(self) -> dict[str, Any]:
        """The Batch object as OpenAI's API returns it."""
        times = {
            f"{s}_at": _int(self.times.get(f"{s}_at"))
            for s in ("in_progress", "finalizing", "completed", "failed", "expired")
        }
        times |= {f"{s}_at": _int(self.times.get(f"{s}_at")) for s in ("cancelling", "cancelled")}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None,
            "input_file_id": self.input_file_id,
            "completion_window": COMPLETION_WINDOW,
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at),
            "expires_at": int(self.expires_at),
            **times,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class FileMeta:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    tenant: str = "default"  # whose it is: only that tenant's requests see it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


# -- the input file ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InputLine:
    line_no: int  # 1-based, as an editor counts
    custom_id: str
    url: str
    body: bytes  # the request body, re-encoded compactly


class InvalidFile(ValueError):
    """A batch input file that cannot be accepted; the message names the line and why."""


def parse_input(data: bytes, max_lines: int, served: Collection[str] = ()) -> list[InputLine]:
    """The request lines of a ``purpose=batch`` JSONL file, or InvalidFile naming the first
    bad line: JSON objects with a unique ``custom_id``, ``method`` POST, ``url`` one of
    ENDPOINTS and ``body`` an object that does not ask to stream (a batch answer is whole)
    and names a model in ``served`` (``model_problem``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidFile(f"the file is not UTF-8 text (byte {exc.start})") from None
    lines: list[InputLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            raise InvalidFile(f"the file has more than batch.max_lines ({max_lines}) requests")
        line = _parse_line(raw, number, served)
        if line.custom_id in seen:
            raise InvalidFile(f"line {number}: custom_id {line.custom_id!r} is used twice")
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise InvalidFile("the file has no request lines")
    return lines


def _parse_line(raw: str, number: int, served: Collection[str]) -> InputLine:
    def bad(why: str) -> InvalidFile:
        return InvalidFile(f"line {number}: {why}")

    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(obj, dict):
        raise bad("must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise bad(f"custom_id must be a string of 1-{MAX_CUSTOM_ID} characters")
    if obj.get("method") != "POST":
        raise bad(f'method must be "POST", got {obj.get("method")!r}')
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise bad(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise bad("body must be a JSON object (the request)")
    if body.get("stream"):
        raise bad("body.stream must not be true: a batch answer is stored whole")
    problem = model_problem(body.get("model"), served)
    if problem is not None:
        raise bad(f"body.model: {problem}")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise bad(f"unknown field(s) {', '.join(sorted(unknown))}")
    encoded = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    return InputLine(number, custom_id, url, encoded)


def model_problem(model: object, served: Collection[str]) -> str | None:
    """Why a batch request's model cannot run on this router (None: it can). ``served`` is
    the router's model catalog; empty while it is not known yet (no replica has answered a
    probe), when any name passes, as online requests do: their lines then fail one by one
    with model_not_found when they run, if the catalog refuses them by then."""
    if not isinstance(model, str) or not model:
        return "required, the name of a model this router serves"
    if served and model not in served:
        names = ", ".join(sorted(served))
        return f"{model!r} is not a model this router serves (it serves: {names})"
    return None


def check_create(body: Any, known_windows: tuple[str, ...] = (COMPLETION_WINDOW,)) -> str | None:
    """Why a POST /v1/batches body is unusable (None: it is usable); the param at fault first."""
    if not isinstance(body, dict):
        return "body: the request body must be a JSON object"
    if not isinstance(body.get("input_file_id"), str) or not body["input_file_id"]:
        return "input_file_id: required, the id of a file uploaded with purpose=batch"
    if body.get("endpoint") not in ENDPOINTS:
        return f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {body.get('endpoint')!r}"
    if body.get("completion_window") not in known_windows:
        return f"completion_window: must be {COMPLETION_WINDOW!r}, got {body.get('completion_window')!r}"
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
            return f"metadata: must be an object of at most {MAX_METADATA_KEYS} pairs"
        for k, v in metadata.items():
            if not (isinstance(v, str) and len(k) <= 64 and len(v) <= 512):
                return "metadata: keys are strings of at most 64 characters, values of 512"
    return None


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """What one line ended with: an HTTP answer (any status) or an error without one."""

    status_code: int | None  # None: no answer (a router-side error)
    body: bytes  # the answer's body, or b"" without one
    request_id: str
    error_code: str | None = None  # set for every failed line
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and self.status_code < 400


def result_line(
    batch_id: str, line_no: int, custom_id: str, result: Result | None, code: str
) -> bytes:
    """One line of the output file (an ok result) or the error file (anything else); a line
    without a result never ran, and gets ``code`` (batch_expired, batch_cancelled)."""
    response: dict[str, Any] | None = None
    error: dict[str, str | None] | None = None
    if result is None:
        error = {"code": code, "message": _SKIPPED.get(code, "the line never ran")}
    else:
        if result.status_code is not None:
            response = {
                "status_code": result.status_code,
                "request_id": result.request_id,
                "body": _json_or_text(result.body),
            }
        if not result.ok:
            error = {"code": result.error_code, "message": result.error_message}
    obj = {
        "id": f"{batch_id}-req-{line_no}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


_SKIPPED = {
    "batch_expired": "The batch expired before this request ran.",
    "batch_cancelled": "The batch was cancelled before this request ran.",
}


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return body.decode("utf-8", "replace")


def error_of(status: int, body: bytes) -> tuple[str, str]:
    """A failed answer's code and message, from an OpenAI- or vLLM-shaped error body."""
    parsed = _json_or_text(body)
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        err = inner if isinstance(inner, dict) else parsed
        message = err.get("message")
        code = err.get("code")
        return (
            str(code) if isinstance(code, str) and code else f"http_{status}",
            str(message) if message else f"HTTP {status}",
        )
    return f"http_{status}", f"HTTP {status}"


def render_files(
    batch_id: str, final: Status, outcomes: list[tuple[int, str, Result | None]]
) -> tuple[bytes | None, bytes | None]:
    """A job's output file (lines answered 2xx) and error file (every other line, those that
    never ran included), in input order; None for a file that would be empty."""
    code = skipped_code(final)
    output: list[bytes] = []
    errors: list[bytes] = []
    for line_no, custom_id, result in outcomes:
        line = result_line(batch_id, line_no, custom_id, result, code)
        (output if result is not None and result.ok else errors).append(line)
    return (b"".join(output) or None, b"".join(errors) or None)
