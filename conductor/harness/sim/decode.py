"""A decode instance with continuous batching, simulated analytically.

Between two changes of batch membership every step adds one token to each member,
so with ``B`` members and total context ``C`` step ``j`` takes
``step(B, C + j·B)``; treating that as affine in ``j`` (exact for an affine step
model, and segments are short) gives the time of ``n`` steps in closed form, so
the simulator jumps from one membership change to the next instead of stepping.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class DecodeJob:
    """One request in (or waiting for) a decode batch."""

    rid: int
    prompt_tokens: int
    output_tokens: int
    ready_s: float
    """When its KV arrived (prefill end + transfer)."""
    start_s: float = math.nan
    finish_s: float = math.nan
    join_step: int = 0
    finish_step: int = 0

    @property
    def reserve_tokens(self) -> int:
        # Reserve the final context up front: no preemption, no mid-decode OOM.
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class DecodeInstance:
    node_id: str
    step_seconds: Callable[[int, int], float]
    kv_tokens: int
    max_batch: int
    t0: float = 0.0
    """Time of the current step boundary (may lie slightly after the last event)."""
    steps: int = 0
    """Steps executed up to ``t0``."""
    ctx: int = 0
    """Sum of the members' context tokens at ``t0``."""
    used_kv: int = 0
    members: dict[int, DecodeJob] = field(default_factory=dict)
    finishing: list[tuple[int, int]] = field(default_factory=list)
    waiting: deque[DecodeJob] = field(default_factory=deque)
    busy_s: float = 0.0
    tokens: int = 0
    version: int = 0
    assigned: int = 0
    """Requests placed here whose prefill or KV transfer is still running."""
    assigned_ctx: int = 0
    assigned_kv: int = 0

    def expect(self, prompt_tokens: int, output_tokens: int, sign: int = 1) -> None:
        """Count (``sign=1``) or uncount (``-1``) a request placed here but not arrived yet, as
        the routing worker's in-flight reservations do."""
        self.assigned += sign
        self.assigned_ctx += sign * (prompt_tokens + 1)
        self.assigned_kv += sign * (prompt_tokens + output_tokens)

    @property
    def batch(self) -> int:
        return len(self.members)

    def _coeffs(self) -> tuple[float, float]:
        b = len(self.members)
        s0 = self.step_seconds(b, self.ctx)
        d = max(0.0, self.step_seconds(b, self.ctx + b) - s0)
        return s0, d

    @staticmethod
    def _span(n: int, s0: float, d: float) -> float:
        return n * s0 + d * n * (n - 1) / 2.0

    @staticmethod
    def _steps_within(e: float, s0: float, d: float) -> int:
        """Whole steps that fit in ``e`` seconds."""
        if d <= 1e-15:
            n = int(e // s0)
        else:
            a = s0 - d / 2.0
            n = int((-a + math.sqrt(a * a + 2.0 * d * e)) / d)
        span = DecodeInstance._span
        while n > 0 and span(n, s0, d) > e:
            n -= 1
        while span(n + 1, s0, d) <= e:
            n += 1
        return n

    def _run_steps(self, n: int, s0: float, d: float) -> None:
        dt = self._span(n, s0, d)
        b = len(self.members)
        self.t0 += dt
        self.busy_s += dt
        self.steps += n
        self.ctx += n * b
        self.tokens += n * b

    def _retire(self, done: list[DecodeJob]) -> None:
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, rid = heapq.heappop(self.finishing)
            job = self.members.pop(rid)
            job.finish_s = self.t0
            self.ctx -= job.prompt_tokens + 1 + (self.steps - job.join_step)
            self.used_kv -= job.reserve_tokens
            done.append(job)

    def advance(self, t: float) -> list[DecodeJob]:
        """Run the batch up to the first step boundary at or after ``t``; returns finished jobs."""
        done: list[DecodeJob] = []
        while True:
            if not self.members:
                self.t0 = max(self.t0, t)
                break
            if t <= self.t0:
                break
            s0, d = self._coeffs()
            k = self.finishing[0][0] - self.steps
            tf = self.t0 + self._span(k, s0, d)
            if tf <= t:
                self._run_steps(k, s0, d)
                self._retire(done)
                self._admit(done)
                continue
            n = self._steps_within(t - self.t0, s0, d)
            # The step in progress at t completes before anything joins (iteration-level batching).
            self._run_steps(min(n + 1, k), s0, d)
            self._retire(done)
            self._admit(done)
            break
        return done

    def fits(self, job: DecodeJob) -> bool:
        return len(self.members) < self.max_batch and self.used_kv + job.reserve_tokens <= self.kv_tokens

    def _admit(self, done: list[DecodeJob]) -> None:
        while self.waiting:
            job = self.waiting[0]
            if not self.fits(job) and self.members:
                break
            # An idle instance takes even an oversized job rather than wedge forever.
            self.waiting.popleft()
            self._join(job, done)

    def _join(self, job: DecodeJob, done: list[DecodeJob]) -> None:
        job.start_s = self.t0
        job.join_step = self.steps
        job.finish_step = self.steps + job.output_tokens - 1
        if job.output_tokens <= 1:
            job.finish_s = self.t0
            done.append(job)
            return
        self.members[job.rid] = job
        heapq.heappush(self.finishing, (job.finish_step, job.rid))
        self.ctx += job.prompt_tokens + 1
        self.used_kv += job.reserve_tokens

    def submit(self, job: DecodeJob, t: float) -> list[DecodeJob]:
        """``job``'s KV arrived at ``t``: it joins at the next step boundary, or waits for room."""
        done = self.advance(t)
        self.waiting.append(job)
        self._admit(done)
        return done

    def next_finish_time(self) -> float | None:
        if not self.members:
            return None
        s0, d = self._coeffs()
        return self.t0 + self._span(self.finishing[0][0] - self.steps, s0, d)

    def load(self) -> tuple[int, int, int]:
        """(batch size, context tokens, free KV tokens), counting the running batch, the jobs
        waiting for room and the requests still in prefill or transfer."""
        wait_ctx = sum(j.prompt_tokens + 1 for j in self.waiting)
        wait_kv = sum(j.reserve_tokens for j in self.waiting)
        return (
            len(self.members) + len(self.waiting) + self.assigned,
            self.ctx + wait_ctx + self.assigned_ctx,
            max(0, self.kv_tokens - self.used_kv - wait_kv - self.assigned_kv),
        )
