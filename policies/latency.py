"""Per-replica latency in seconds: time to first token and time per output token, learnt online.

Two straight lines, one per phase, fitted to what each replica really did:

    TTFT(work) = ttft_base_s + prefill_s_per_token x work
        work: the uncached prompt tokens queued ahead of a request on that replica, plus its own
        (and, with kv_aware's time cost, the loads from lower KV tiers as prefill tokens)
    TPOT(batch) = tpot_base_s + tpot_per_seq_s x batch
        batch: the sequences decoding there at once

The prior (``LatencyPrior``) comes from a roofline preset or the config; each observation pulls
the fit towards the replica's own figures. A fit is a ridge regression: exponentially weighted
sums of the observations (recent ones count most, so a replica that slows down is seen within a
few dozen requests) plus the prior as a penalty, so a line with few or clustered points (every
request the same size) keeps the prior's slope instead of an absurd one.

Pure: the dispatch ledger feeds prefill observations (its own clock from dispatch to first token,
paired with the work it had queued there), the metrics scraper feeds decode ones (the replica's
inter-token latency histogram over a scrape interval, paired with its running batch); the policy
only reads ``ttft`` and ``tpot``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyPrior:
    """What a replica is expected to do before it has been seen (seconds)."""

    ttft_base_s: float = 0.009
    prefill_s_per_token: float = 3.2e-5
    tpot_base_s: float = 0.007
    tpot_per_seq_s: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("ttft_base_s", "prefill_s_per_token", "tpot_base_s", "tpot_per_seq_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def at_speed(self, speed: float) -> LatencyPrior:
        """These lines on a replica ``speed`` times as fast (0.5: every step takes twice as
        long): where a replica the operator calls slower or faster starts learning from."""
        if speed == 1.0:
            return self
        return LatencyPrior(
            self.ttft_base_s / speed,
            self.prefill_s_per_token / speed,
            self.tpot_base_s / speed,
            self.tpot_per_seq_s / speed,
        )


class _Line:
    """y = a + b x: exponentially weighted least squares, ridge-pulled to a prior line."""

    __slots__ = (
        "a",
        "a0",
        "b",
        "b0",
        "decay",
        "lam_a",
        "lam_b",
        "s0",
        "sx",
        "sxx",
        "sxy",
        "sy",
        "syy",
    )

    def __init__(self, a0: float, b0: float, x_scale: float, strength: float, half_life: float):
        self.a0, self.b0 = a0, b0
        self.a, self.b = a0, b0
        # The prior weighs as much as ``strength`` observations at a typical x.
        self.lam_a = strength
        self.lam_b = strength * x_scale * x_scale
        self.decay = 0.5 ** (1.0 / half_life)
        self.s0 = self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.s0 = self.s0 * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.syy = self.syy * d + y * y
        # Minimise sum w (y - a - b x)^2 + lam_a (a - a0)^2 + lam_b (b - b0)^2: a 2x2 system.
        m00 = self.s0 + self.lam_a
        m01 = self.sx
        m11 = self.sxx + self.lam_b
        r0 = self.sy + self.lam_a * self.a0
        r1 = self.sxy + self.lam_b * self.b0
        det = m00 * m11 - m01 * m01
        if det <= 0:
            return
        a = (r0 * m11 - m01 * r1) / det
        b = (m00 * r1 - m01 * r0) / det
        if b < 0:  # more work never makes a step faster: refit the level with a flat line
            b = 0.0
            a = (r0 - m01 * b) / m00
        self.a = a if a > 0 else 0.0
        self.b = b

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    def state(self) -> list[float]:
        """What the fit has learnt (its sums and line), for a snapshot; the prior is not in it."""
        return [self.s0, self.sx, self.sy, self.sxx, self.sxy, self.syy, self.a, self.b]

    def load(self, state: list[float]) -> bool:
        """Take over another fit's ``state()``; False (nothing changed) if it is not one."""
        if len(state) != 8 or not all(math.isfinite(v) for v in state) or state[0] < 0:
            return False
        self.s0, self.sx, self.sy, self.sxx, self.sxy, self.syy, self.a, self.b = state
        return True

    def a_stderr(self) -> float:
        """The standard error of the level ``a``: the weighted residuals' variance through the
        same 2x2 system. Zero before any observation (the prior is taken as exact)."""
        if self.s0 <= 0:
            return 0.0
        a, b = self.a, self.b
        rss = (
            self.syy - 2 * a * self.sy - 2 * b * self.sxy
            + a * a * self.s0 + 2 * a * b * self.sx + b * b * self.sxx
        )  # fmt: skip
        m00, m11 = self.s0 + self.lam_a, self.sxx + self.lam_b
        det = m00 * m11 - self.sx * self.sx
        if rss <= 0 or det <= 0:
            return 0.0
        return math.sqrt(rss / self.s0 * m11 / det)


class ReplicaLatency:
    """One replica's two latency lines (see the module doc)."""

    __slots__ = ("_decode", "_prefill", "decode_samples", "prefill_samples")

    def __init__(self, prior: LatencyPrior, strength: float = 4.0, half_life: float = 64.0):
        self._prefill = _Line(
            prior.ttft_base_s, prior.prefill_s_per_token, 2048.0, strength, half_life
        )
        self._decode = _Line(prior.tpot_base_s, prior.tpot_per_seq_s, 16.0, strength, half_life)
        self.prefill_samples = 0
        self.decode_samples = 0

    def observe_prefill(self, work_tokens: int, seconds: float) -> None:
        """A request's first token came ``seconds`` after dispatch with ``work_tokens`` of
        uncached prompt queued there (its own included)."""
        if seconds >= 0 and math.isfinite(seconds) and work_tokens >= 0:
            self._prefill.observe(float(work_tokens), seconds)
            self.prefill_samples += 1

    def observe_decode(self, batch: float, tpot_s: float) -> None:
        """The replica's mean inter-token latency over an interval with ``batch`` running."""
        if tpot_s > 0 and math.isfinite(tpot_s) and batch >= 0:
            self._decode.observe(batch, tpot_s)
            self.decode_samples += 1

    def state(self) -> tuple[list[float], list[float], int, int]:
        """Both fits and their sample counts: what another router loads to start where this
        one is (a warm start, router/warm_start.py)."""
        return (
            self._prefill.state(),
            self._decode.state(),
            self.prefill_samples,
            self.decode_samples,
        )

    def load(self, prefill: list[float], decode: list[float], samples: tuple[int, int]) -> bool:
        """Take over another router's lines of this replica (``state()``); False, with nothing
        changed, if they do not read as lines."""
        if min(samples) < 0:
            return False
        before = self._prefill.state()
        if not self._prefill.load(prefill):
            return False
        if not self._decode.load(decode):
            self._prefill.load(before)
            return False
        self.prefill_samples, self.decode_samples = samples
        return True

    def ttft(self, work_tokens: float) -> float:
        return self._prefill(work_tokens)

    def tpot(self, batch: float) -> float:
        return self._decode(batch)

    @property
    def prefill_base_s(self) -> float:
        """The prefill line's level: TTFT with nothing queued."""
        return self._prefill.a

    @property
    def prefill_base_stderr_s(self) -> float:
        """How sure that level is: its standard error from the observations' scatter."""
        return self._prefill.a_stderr()

    @property
    def prefill_s_per_token(self) -> float:
        """The prefill line's slope: what one more queued token adds to TTFT."""
        return self._prefill.b

    def describe(self) -> dict[str, float | int]:
        """The fitted lines, for /admin/replicas."""
        return {
            "ttft_base_s": self._prefill.a,
            "prefill_s_per_token": self._prefill.b,
            "tpot_base_s": self._decode.a,
            "tpot_per_seq_s": self._decode.b,
            "prefill_samples": self.prefill_samples,
            "decode_samples": self.decode_samples,
        }
