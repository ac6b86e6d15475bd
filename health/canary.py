"""The output-drift canary: a few fixed prompts, run greedily on every replica, compared.

A replica whose weights, kernels or engine went wrong still answers /health and serves traffic
fast; only its output is wrong. So each round sends every replica the same fixed prompts
(temperature 0, a seed, the top-2 logprobs of each token) straight to the replica, as the
health probe does: canary requests never pass through the routing ledger and never count as
client traffic. ``drift.py`` judges the answers; this module asks, applies the verdicts and keeps
the fleet's fingerprint (what the fleet answered last, on disk if ``fingerprint_file`` is set,
so that a restart or a deploy is compared with the fleet from before it).

Rounds run every ``interval_s``, and at once when a replica becomes healthy (new, restarted,
or back after a rollout). A replica judged ``drift`` is quarantined (``ReplicaState.quarantined``:
out of rotation), unless that would leave a model it serves with no replica in rotation; a later
round that finds it agreeing (or merely near-tied) puts it back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvroute.policies import ReplicaState

from .drift import (
    AGREE,
    DISAGREE,
    DRIFT,
    NEAR_TIE,
    CanaryResult,
    DriftState,
    Verdict,
    judge_prompt,
    worst,
)
from .probe import describe_failure

log = logging.getLogger(__name__)

# Short, plain prompts any text model continues; 16 greedy tokens of each are plenty to tell
# different weights apart, and cost a replica next to nothing.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
FINGERPRINT_VERSION = 1
TOKEN_ID_PREFIX = "token_id:"  # vLLM's "return_tokens_as_token_ids" spelling of a token


@dataclass(frozen=True, slots=True)
class CanarySettings:
    interval_s: float = 300.0
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 16
    # Nats between the top-1 and top-2 logprob below which a flip is a near-tie (see README).
    min_margin: float = 0.5
    seed: int = 0
    timeout_s: float = 30.0
    fingerprint_file: str | None = None


class CanaryTarget(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def base_url(self) -> str: ...

    @property
    def state(self) -> ReplicaState: ...

    drift: DriftState


@dataclass(slots=True)
class RoundReport:
    """One round: each replica's verdict (its worst over prompts and models)."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)  # newly, this round
    released: list[str] = field(default_factory=list)
    # (model, prompt) whose whole-fleet answer changed since the recorded fingerprint.
    fleet_changed: list[tuple[str, str]] = field(default_factory=list)


class CanaryRunner:
    def __init__(
        self,
        replicas: Callable[[], Sequence[CanaryTarget]],
        settings: CanarySettings,
        *,
        adapters: Callable[[str], frozenset[str]] = lambda name: frozenset(),
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._replicas = replicas
        self.settings = settings
        # LoRA adapters a replica serves (its other model names are base models, canaried).
        self._adapters = adapters
        self._on_change = on_change
        # Every check, (replica, verdict): the router's metrics read it (set by the router).
        self.on_check: Callable[[str, str], None] = lambda replica, result: None
        # (model, prompt) -> what the fleet answered last.
        self.fingerprint: dict[tuple[str, str], CanaryResult] = self._load_fingerprint()
        self._client = httpx.AsyncClient(timeout=settings.timeout_s, trust_env=False)
        self._lock = asyncio.Lock()  # one round at a time, whoever starts it
        self._wake = asyncio.Event()
        self._healthy: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    # -- scheduling ---------------------------------------------------------------------

    def start(self) -> None:
        self.replicas_changed()
        self._task = asyncio.create_task(self._run(), name="kvroute-drift-canary")

    def replicas_changed(self) -> None:
        """Probes changed something: a replica that just became healthy (new, restarted,
        rolled out) gets a round now rather than at the next interval."""
        healthy = {r.name for r in self._replicas() if r.state.healthy}
        if healthy - self._healthy:
            self._wake.set()
        self._healthy = healthy

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.settings.interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()  # before the round: a replica joining during it gets another
            try:
                await self.run_round()
            except Exception:  # a bug in one round must not end the canary for good
                log.exception("drift canary round failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    # -- one round ------------------------------------------------------------------------

    async def run_round(self) -> RoundReport:
        """Ask every healthy replica (quarantined ones too: that is how they come back),
        judge per model and prompt, apply the verdicts."""
        async with self._lock:
            targets = [r for r in self._replicas() if r.state.healthy and r.state.models]
            models = {t.name: sorted(t.state.models or ()) for t in targets}
            for t in targets:
                adapters = self._adapters(t.name)
                models[t.name] = [m for m in models[t.name] if m not in adapters]
            answers = await asyncio.gather(*(self._ask_all(t, models[t.name]) for t in targets))
            by_replica = dict(zip((t.name for t in targets), answers, strict=True))
            report = RoundReport()
            verdicts: dict[str, list[Verdict]] = {t.name: [] for t in targets}
            groups: dict[str, list[str]] = {}
            for t in targets:
                for model in models[t.name]:
                    groups.setdefault(model, []).append(t.name)
            dirty = False
            for model, names in sorted(groups.items()):
                for prompt in self.settings.prompts:
                    key = (model, prompt)
                    judged = judge_prompt(
                        prompt,
                        {name: by_replica[name][key] for name in names},
                        self.settings.min_margin,
                        self.fingerprint.get(key),
                    )
                    for name, verdict in judged.verdicts.items():
                        verdicts[name].append(verdict)
                        self.on_check(name, verdict.result)
                    if judged.fleet_changed:
                        report.fleet_changed.append(key)
                        log.warning(
                            "drift canary: every replica of %s now answers %r differently from "
                            "the recorded fingerprint (a deploy changed the output fleet-wide); "
                            "recording the new answer",
                            model,
                            prompt,
                        )
                    if judged.record is not None and judged.record != self.fingerprint.get(key):
                        self.fingerprint[key] = judged.record
                        dirty = True
            self._apply(targets, verdicts, report)
            if dirty:
                await self._save_fingerprint()
            return report

    def _apply(
        self,
        targets: Sequence[CanaryTarget],
        verdicts: dict[str, list[Verdict]],
        report: RoundReport,
    ) -> None:
        now = time.time()
        suspects = []
        for target in targets:
            verdict = worst(verdicts[target.name])
            report.verdicts[target.name] = verdict
            drift = target.drift
            drift.last_result, drift.checked_at = verdict.result, now
            drift.last_divergence, drift.last_error = verdict.divergence, verdict.error
            if verdict.result == DRIFT and not drift.quarantined:
                suspects.append((target, verdict))
            elif verdict.result in (AGREE, NEAR_TIE) and drift.quarantined:
                drift.quarantined, drift.quarantined_at, drift.quarantine = False, None, None
                target.state.quarantined = False
                report.released.append(target.name)
                log.info("replica %s agrees with the fleet again: back in rotation", target.name)
            elif verdict.result in (NEAR_TIE, DISAGREE) and verdict.divergence is not None:
                d = verdict.divergence
                log.info(
                    "drift canary: replica %s differs on %r at token %d (%s, margin %s)",
                    target.name,
                    d.prompt,
                    d.position,
                    verdict.result,
                    d.margin,
                )
        for target, verdict in suspects:
            found = verdict.divergence
            assert found is not None  # drift always names its divergence
            if self._last_in_rotation(target):
                log.error(
                    "drift canary: replica %s drifts (%r, token %d) but is the last replica in "
                    "rotation for a model it serves: left in rotation",
                    target.name,
                    found.prompt,
                    found.position,
                )
                continue
            drift = target.drift
            drift.quarantined, drift.quarantined_at, drift.quarantine = True, now, found
            target.state.quarantined = True
            report.quarantined.append(target.name)
            log.warning(
                "replica %s quarantined for output drift: on %r its token %d is %s where the "
                "%s has %s (margins %s / %s nats)",
                target.name,
                found.prompt,
                found.position,
                found.got[:1],
                found.reference,
                found.expected[:1],
                found.got_margin,
                found.expected_margin,
            )
        if report.quarantined or report.released:
            self._on_change()

    def _last_in_rotation(self, target: CanaryTarget) -> bool:
        """Whether quarantining ``target`` would leave one of its models with no replica."""
        others = [
            r.state
            for r in self._replicas()
            if r.name != target.name
            and r.state.healthy
            and not r.state.ejected
            and not r.state.quarantined
        ]
        for model in target.state.models or ():
            if not any(s.models is None or model in s.models for s in others):
                return True
        return False

    # -- asking a replica ------------------------------------------------------------------

    async def _ask_all(
        self, target: CanaryTarget, models: list[str]
    ) -> dict[tuple[str, str], CanaryResult | str]:
        # One prompt at a time per replica: the canary's own requests never batch together,
        # which keeps its batches (and so its arithmetic) the same on every replica.
        answers: dict[tuple[str, str], CanaryResult | str] = {}
        for model in models:
            for prompt in self.settings.prompts:
                answers[(model, prompt)] = await self._ask(target.base_url, model, prompt)
        return answers

    async def _ask(self, base_url: str, model: str, prompt: str) -> CanaryResult | str:
        """The replica's greedy continuation, or why there is none."""
        url = base_url + "/v1/completions"
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.settings.max_tokens,
            "temperature": 0,
            "seed": self.settings.seed,
            "logprobs": 2,
            # Same length everywhere, and token ids rather than text: nothing to detokenize.
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        headers = {"X-Request-Id": f"kvroute-canary-{uuid.uuid4().hex}"}
        try:
            response = await self._client.post(url, json=body, headers=headers)
        except (httpx.HTTPError, OSError) as exc:
            return describe_failure(url, exc, self.settings.timeout_s)
        if response.status_code != 200:
            text = " ".join(response.text.split())[:200]
            return f"POST {url} answered {response.status_code}: {text}"
        try:
            return parse_completion(response.json())
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return f"POST {url}: unexpected answer: {exc}"

    # -- the fingerprint on disk ------------------------------------------------------------

    def _load_fingerprint(self) -> dict[tuple[str, str], CanaryResult]:
        path = self.settings.fingerprint_file
        if path is None or not os.path.exists(path):
            return {}
        try:
            raw = json.loads(Path(path).read_text())
            if raw.get("version") != FINGERPRINT_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, expected {FINGERPRINT_VERSION}")
            if raw.get("max_tokens") != self.settings.max_tokens:
                log.warning(
                    "canary fingerprint %s was recorded with max_tokens %s, now %d: not used",
                    path,
                    raw.get("max_tokens"),
                    self.settings.max_tokens,
                )
                return {}
            return {
                (model, prompt): CanaryResult.from_dict(result)
                for model, prompts in raw["models"].items()
                for prompt, result in prompts.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning(
                "canary fingerprint %s cannot be read (%s): starting without one", path, exc
            )
            return {}

    async def _save_fingerprint(self) -> None:
        path = self.settings.fingerprint_file
        if path is None:
            return
        models: dict[str, dict[str, Any]] = {}
        for (model, prompt), result in sorted(self.fingerprint.items()):
            models.setdefault(model, {})[prompt] = result.to_dict()
        doc = {
            "version": FINGERPRINT_VERSION,
            "max_tokens": self.settings.max_tokens,
            "models": models,
        }
        try:
            await asyncio.to_thread(_write_atomically, Path(path), json.dumps(doc, indent=1))
        except OSError as exc:
            log.warning("canary fingerprint %s cannot be written: %s", path, exc)


def parse_completion(data: Any) -> CanaryResult:
    """A /v1/completions answer with logprobs as a ``CanaryResult``.

    Token ids come from ``choices[0].token_ids`` (vLLM's ``return_token_ids``), else from the
    logprobs' tokens spelt ``token_id:N`` (``return_tokens_as_token_ids``); each position's top
    logprobs from ``logprobs.top_logprobs``.
    """
    choice = data["choices"][0]
    logprobs = choice["logprobs"]
    if not isinstance(logprobs, dict):
        raise ValueError("no logprobs (the replica ignored 'logprobs')")
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        ids = [_token_id(t) for t in logprobs["tokens"]]
    tops = []
    for top in logprobs["top_logprobs"]:
        values = sorted((float(v) for v in (top or {}).values()), reverse=True)
        tops.append(tuple(values[:2]))
    return CanaryResult(tuple(ids), tuple(tops), str(choice.get("text") or ""))


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"token {token!r} is not spelt {TOKEN_ID_PREFIX}N")
    return int(token[len(TOKEN_ID_PREFIX) :])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
