"""A request's session and program (kvcore/agent_identity.py), and how each was found, on
/metrics: kvroute_sessions_detected_total{source}, ``source`` one of a fixed few rules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from kvroute.kvcore.agent_identity import SOURCES, Identity, detect
from kvroute.kvcore.fair_queue import FairQueue

from .openai_request import ParsedRequest


def identify(
    headers: Mapping[str, str], parsed: ParsedRequest, configured_header: str | None
) -> Identity:
    """The request's identity from its headers and the top-level fields its parse kept."""
    return detect(headers, parsed.fields or {}, configured_header)


# /status lists at most this many programs, and this much of each name (client-chosen ids).
STATUS_PROGRAMS = 5
STATUS_NAME_CHARS = 48


def agents_summary(metrics: SessionMetrics, queue: FairQueue) -> dict[str, Any]:
    """The /status page's agents line: requests by the rule that found their session, and by
    program (fairness.by: program) how many programs are remembered, how many wait, and the
    ones with the most requests waiting, with what each has received."""
    queued = {name: n for name, n in queue.queued_programs().items() if name}
    busiest = sorted(queued.items(), key=lambda item: (-item[1], item[0]))[:STATUS_PROGRAMS]
    return {
        "sessions_by_source": {k: v for k, v in metrics.detected.items() if v},
        "fairness_by": queue.params.by,
        "programs_remembered": len(queue.programs),
        "programs_waiting": len(queued),
        "waiting": [
            {
                "program": name[:STATUS_NAME_CHARS],
                "queued": count,
                "received_tokens": round(queue.attained(name)),
            }
            for name, count in busiest
        ],
    }


class SessionMetrics:
    """kvroute_sessions_detected_total (a ``RouterMetrics`` part)."""

    def __init__(self) -> None:
        self.detected: dict[str, int] = dict.fromkeys(SOURCES, 0)

    def count(self, identity: Identity) -> None:
        self.detected[identity.source] += 1

    def snapshot(self) -> Any:
        return {"detected": dict(self.detected)}

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "kvroute_sessions_detected",
            "Requests by the rule that found their session, counted as they reach admission "
            "(kvcore/agent_identity.py): "
            "configured_header (routing.session_header), x_session_id, claude_code "
            "(X-Claude-Code-Session-Id or the session part of metadata.user_id), opencode "
            "(x-opencode-session, x-session-affinity), codex (the session_id header), vllm "
            "(the body's session_id or vllm_xargs.session_id), prompt_cache_key, user (the "
            "body's user or metadata.user_id whole); none: no session found.",
            labels=["source"],
        )
        merged = dict(self.detected)
        for peer in peers:
            for source, count in peer.get("detected", {}).items():
                if source in merged:
                    merged[source] += count
        for source in SOURCES:
            family.add_metric([source], merged[source])
        yield family
