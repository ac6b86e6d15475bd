"""Anthropic's Message Batches on the batch lane's jobs and lines: the pure parts.

A Message Batch is a ``Job`` whose endpoint is ``/v1/messages`` and whose lines are its
requests (``custom_id`` and ``params``, the params a line's body); it runs, paces, cancels,
expires and survives restarts as any job. What differs is only how it is shown: the
MessageBatch object (``to_message_batch``) and its results file, rendered once when the job
ends (``render_results``), one ``{"custom_id", "result"}`` line per request, in request order.
No I/O, no clock: times come in.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from ..errors import anthropic_error_type
from .model import Job, Result, Status, error_of

MESSAGES_ENDPOINT = "/v1/messages"
ID_PREFIX = "msgbatch_"
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The batch lane's states as Anthropic's three processing statuses.
_ENDED = (Status.COMPLETED, Status.EXPIRED, Status.CANCELLED, Status.FAILED)


def processing_status(status: Status) -> str:
    if status == Status.CANCELLING:
        return "canceling"
    return "ended" if status in _ENDED else "in_progress"


def to_message_batch(job: Job, results_url: str | None) -> dict[str, Any]:
    """The MessageBatch object. As Anthropic documents it, every request counts as
    ``processing`` until the whole batch ends; then each counts as what it ended as.
    ``results_url`` is shown once the batch has ended."""
    ended = processing_status(job.status) == "ended"
    counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
    if ended:
        counts["succeeded"] = job.completed
        counts["errored"] = job.failed - job.skipped
        counts["expired" if job.status == Status.EXPIRED else "canceled"] = job.skipped
    else:
        counts["processing"] = job.total
    return {
        "id": job.id,
        "type": "message_batch",
        "processing_status": processing_status(job.status),
        "request_counts": counts,
        "ended_at": _time(job.times.get(f"{job.status.value}_at")) if ended else None,
        "created_at": _time(job.created_at),
        "expires_at": _time(job.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _time(job.times.get("cancelling_at")),
        "results_url": results_url if ended else None,
    }


def deleted(batch_id: str) -> dict[str, str]:
    return {"id": batch_id, "type": "message_batch_deleted"}


def _time(when: float | None) -> str | None:
    """An RFC 3339 time, as Anthropic's API writes them."""
    if when is None:
        return None
    return datetime.fromtimestamp(when, UTC).isoformat().replace("+00:00", "Z")


def check_request(index: int, item: Any) -> str | None:
    """Why ``requests[index]`` (before its params are checked as a Messages request) is
    unusable; None when it is usable."""
    where = f"requests[{index}]"
    if not isinstance(item, dict):
        return f"{where}: must be an object with custom_id and params"
    unknown = set(item) - {"custom_id", "params"}
    if unknown:
        return f"{where}: unknown field(s) {', '.join(sorted(unknown))}"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        return f"{where}.custom_id: must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
    params = item.get("params")
    if not isinstance(params, dict):
        return f"{where}.params: must be an object (a Messages request)"
    if params.get("stream"):
        return f"{where}.params.stream: must not be true: a batch answer is stored whole"
    return None


# -- results ---------------------------------------------------------------------------------


def render_results(
    final: Status, outcomes: list[tuple[int, str, Result | None]]
) -> tuple[bytes | None, bytes | None]:
    """An ended Message Batch's results file (every request, in order) as the job's output
    file; no error file (errored requests are results too)."""
    skipped = "expired" if final == Status.EXPIRED else "canceled"
    lines = [result_line(custom_id, result, skipped) for _, custom_id, result in outcomes]
    return b"".join(lines) or None, None


def result_line(custom_id: str, result: Result | None, skipped: str) -> bytes:
    """One line of the results: succeeded (the Message), errored (an Anthropic error), or
    ``skipped`` (canceled, expired) for a request that never ran."""
    outcome: dict[str, Any]
    if result is None:
        outcome = {"type": skipped}
    elif result.ok and isinstance(message := _decoded(result.body), dict):
        outcome = {"type": "succeeded", "message": message}
    elif result.ok:  # a 2xx that is not a Message: no answer the client could use
        error = {"type": "api_error", "message": "The replica's answer is not a JSON object."}
        outcome = {"type": "errored", "error": {"type": "error", "error": error}}
    else:
        outcome = {"type": "errored", "error": _error(result)}
    obj = {"custom_id": custom_id, "result": outcome}
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _error(result: Result) -> dict[str, Any]:
    """The error of a request that failed, in Anthropic's envelope: the type its status has
    in Anthropic's API, and the message the replica (or the router) gave."""
    status = result.status_code
    message = result.error_message
    if status is not None and result.body and message is None:
        message = error_of(status, result.body)[1]
    error_type = anthropic_error_type(status) if status is not None else "api_error"
    return {"type": "error", "error": {"type": error_type, "message": message or "failed"}}


def _decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
