"""What the server's ``GET /metrics`` shows: Prometheus counters of requests, tokens and speculative
acceptance (per draft position and per context bucket, named as vLLM names its counters; accepted
tokens by proposer and context bucket; the shared lookup index's size), plus a window of recent
requests' own tau and acceptance."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from eagle3.draft.metrics import CONTEXT_BUCKETS, PROPOSER_SOURCES, context_bucket
from serve_eval.lookup import SharedLookup
from serve_eval.spec_decode import DecodeStats


class Metrics:
    """Server-wide counters plus a window of recent requests, rendered as Prometheus text."""

    def __init__(self, max_depth: int, recent: int, shared: SharedLookup | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("eagle3_requests", "Finished requests by outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("eagle3_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("eagle3_generation_tokens", "Generated tokens", registry=r)
        self.target_forwards = Counter("eagle3_target_forwards", "Target forwards after prefill", registry=r)
        self.drafts = Counter("eagle3_spec_decode_num_drafts", "Rounds that proposed >= 1 draft token", registry=r)
        self.draft_tokens = Counter("eagle3_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("eagle3_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.proposed_pos = Counter("eagle3_spec_decode_num_draft_tokens_per_pos",
                                    "Rounds that proposed a token at this depth", ["position"], registry=r)
        self.accepted_pos = Counter("eagle3_spec_decode_num_accepted_tokens_per_pos",
                                    "Rounds whose token at this depth was accepted", ["position"], registry=r)
        for i in range(1, max_depth + 1):  # present from the start, at 0
            self.proposed_pos.labels(str(i))
            self.accepted_pos.labels(str(i))
        self.rounds_ctx = Counter("eagle3_spec_decode_rounds_by_context", "Verify rounds by the context before "
                                  "their first drafted token (0-1k, 1-2k, ... tokens)", ["context"], registry=r)
        self.accepted_ctx = Counter("eagle3_spec_decode_accepted_tokens_by_context", "Draft tokens accepted, by the "
                                    "context before their round's first drafted token", ["context"], registry=r)
        self.accepted_by = Counter("eagle3_spec_decode_accepted_tokens_by_proposer", "Draft tokens accepted, by who "
                                   "proposed them: the draft, the lookup, or both", ["proposer", "context"],
                                   registry=r)
        self.lookup_rounds = Counter("eagle3_spec_decode_lookup_rounds", "Rounds whose tree held a lookup branch",
                                     ["context"], registry=r)
        for source in PROPOSER_SOURCES:  # present from the start, at 0
            self.accepted_by.labels(source, CONTEXT_BUCKETS[0])
        if shared is not None:
            for name, text, value in (
                    ("eagle3_lookup_shared_tokens", "Tokens held by the shared lookup index", lambda: shared.tokens),
                    ("eagle3_lookup_shared_replies", "Replies held by the shared lookup index",
                     lambda: len(shared.docs)),
                    ("eagle3_lookup_shared_added", "Replies added to the shared lookup index", lambda: shared.added),
                    ("eagle3_lookup_shared_evicted", "Replies dropped from the shared lookup index (its cap)",
                     lambda: shared.evicted),
                    ("eagle3_lookup_shared_max_tokens", "The shared lookup index's cap", lambda: shared.max_tokens)):
                Gauge(name, text, registry=r).set_function(value)
        self.version = Gauge("eagle3_draft_version", "The draft version served (0: the one the server started "
                             "with; promoted ones count up)", registry=r)
        self.version_rounds = Counter("eagle3_spec_decode_rounds_by_draft_version", "Verify rounds, by the draft "
                                      "version that served them", ["version"], registry=r)
        self.version_accepted = Counter("eagle3_spec_decode_accepted_tokens_by_draft_version", "Draft tokens "
                                        "accepted, by the draft version that served them", ["version"], registry=r)
        self.queue_depth = Gauge("eagle3_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("eagle3_running", "Requests being generated", registry=r)
        self.latency = Histogram("eagle3_request_seconds", "Request latency (queue included)", registry=r,
                                 buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self.lock = threading.Lock()

    def watch(self, name: str, text: str, value: Any) -> None:
        """A gauge read from ``value()`` at each scrape (the live loop's counts)."""
        from prometheus_client import Gauge

        Gauge(name, text, registry=self.registry).set_function(value)

    def watch_live(self, capture: Any, follower: Any) -> None:
        """The live loop's gauges: the capture's counts (``serve_eval.capture.CaptureWriter``) and
        the promoted drafts the server followed or refused (``serve_eval.promoted.DraftFollower``)."""
        if capture is not None:
            for name, text, value in (
                    ("eagle3_capture_requests", "Requests captured as training samples", lambda: capture.written),
                    ("eagle3_capture_paused", "Requests not captured: the capture folder was full",
                     lambda: capture.paused),
                    ("eagle3_capture_max_bytes", "The capture folder's budget", lambda: capture.max_bytes)):
                self.watch(name, text, value)
        if follower is not None:
            for kind in follower.counts:
                self.watch(f"eagle3_draft_{kind}", f"Promoted drafts {kind} by the server",
                           lambda kind=kind: follower.counts[kind])

    def observe_version(self, version: int, stats: DecodeStats) -> None:
        self.version_rounds.labels(str(version)).inc(len(stats.accepted))
        self.version_accepted.labels(str(version)).inc(sum(stats.accepted))

    def observe_round(self, depth: int, accepted: int) -> None:
        self.target_forwards.inc()
        if depth == 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(depth)
        self.accepted.inc(accepted)
        for i in range(1, depth + 1):
            self.proposed_pos.labels(str(i)).inc()
            if i <= accepted:
                self.accepted_pos.labels(str(i)).inc()

    def finish(self, request_id: str, endpoint: str, outcome: str, prompt_tokens: int,
               stats: DecodeStats | None, seconds: float, completion_tokens: int = 0) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.latency.observe(seconds)
        if stats is None:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        sources = stats.sources or [(a, 0, 0) for a in stats.accepted]
        lookup = stats.lookup or [0] * len(stats.accepted)
        for tokens, accepted, by, branch in zip(stats.contexts, stats.accepted, sources, lookup, strict=True):
            bucket = context_bucket(tokens)  # tau of a bucket: 1 + a / r
            self.rounds_ctx.labels(bucket).inc()
            self.accepted_ctx.labels(bucket).inc(accepted)
            for source, count in zip(PROPOSER_SOURCES, by, strict=True):
                if count:
                    self.accepted_by.labels(source, bucket).inc(count)
            if branch:
                self.lookup_rounds.labels(bucket).inc()
        with self.lock:
            self.recent.append({"id": request_id, "tau": stats.tau, "rounds": len(stats.accepted),
                                "accept_per_pos": stats.acceptance_per_position(),
                                "mean_depth": sum(stats.depths) / len(stats.depths) if stats.depths else 0.0})

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        lines = [generate_latest(self.registry).decode()]
        with self.lock:
            recent = list(self.recent)
        lines.append("# HELP eagle3_request_tau Mean tokens per target forward of a recent request\n"
                     "# TYPE eagle3_request_tau gauge\n")
        lines += [f'eagle3_request_tau{{request_id="{r["id"]}"}} {r["tau"]:.6g}\n' for r in recent]
        lines.append("# HELP eagle3_request_mean_depth Mean proposed chain depth of a recent request\n"
                     "# TYPE eagle3_request_mean_depth gauge\n")
        lines += [f'eagle3_request_mean_depth{{request_id="{r["id"]}"}} {r["mean_depth"]:.6g}\n' for r in recent]
        lines.append("# HELP eagle3_request_acceptance Acceptance at a draft position of a recent request\n"
                     "# TYPE eagle3_request_acceptance gauge\n")
        lines += [f'eagle3_request_acceptance{{request_id="{r["id"]}",position="{i}"}} {a:.6g}\n'
                  for r in recent for i, a in enumerate(r["accept_per_pos"], 1)]
        return "".join(lines).encode()


__all__ = ["Metrics"]
