"""The same backlog on SQS + Lambda, as a stated model (no SQS is run), and the prices of both.

Model of an SQS standard queue feeding the worker through an event source mapping with
``MaximumConcurrency`` = the cap and ``BatchSize`` = 10 (no batching window):

* under a backlog every poll returns a full batch, so ``ceil(N / 10)`` invocations, each running
  its 10 messages one after the other: ``10 × handler_ms`` of billed duration, plus
  ``overhead_ms`` per invocation (the model's only free parameter; 0 by default, in SQS's favour);
* ``cap`` invocations at once from the first poll (the mapping scales by up to 300 concurrent
  invocations a minute, so a cap of 8 is reached at once): ``cap × 1000 / handler_ms`` tasks/s,
  the H=1 ideal, exactly: no scale-up delay, no polling gap, no cold start, all in SQS's favour;
* SQS requests per task: one SendMessage per task (a producer that enqueues one task per call,
  as rdq's API does); per batch one ReceiveMessage and one DeleteMessageBatch; each message under
  64 KB (one request each). Empty receives of an idle queue's pollers are not counted.
* Lambda requests: one per invocation. Memory: the worker's, so GB-s compare like for like.

rdq's cost counts the worker function only (its GB-s, measured under the emulator, and its
requests, ticks and fan-out included), on the assumption that the database it uses is already
paid for by the application; the enqueue side is the producer's on both (API Gateway + the API
function for rdq, the producer's own SendMessage calls for SQS: these are counted on the SQS side
because they are the queue's own price).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# List prices, US East (N. Virginia), first pricing tier, on-demand, as published on
# https://aws.amazon.com/lambda/pricing/ and https://aws.amazon.com/sqs/pricing/ and quoted by
# price summaries dated March 2026 (SQS) and 2024-2026 (Lambda); the pages themselves were not
# re-read for this bench. Check them before quoting a figure: only these constants change.
#: SQS standard queue, per million requests (first 100 billion a month).
SQS_STANDARD_PER_MILLION_REQUESTS = 0.40
#: Lambda, per million requests (both architectures).
LAMBDA_PER_MILLION_REQUESTS = 0.20
#: Lambda duration per GB-s, x86_64 (first 6 billion GB-s a month).
LAMBDA_PER_GB_S_X86 = 0.0000166667
#: Lambda duration per GB-s, arm64 (first 7.5 billion GB-s a month).
LAMBDA_PER_GB_S_ARM = 0.0000133334
PRICES_AS_OF = "list prices quoted 2026-03, us-east-1 (aws.amazon.com/lambda/pricing, aws.amazon.com/sqs/pricing)"

SQS_BATCH = 10


def price_per_gb_s(architecture: str) -> float:
    return LAMBDA_PER_GB_S_ARM if architecture == "arm64" else LAMBDA_PER_GB_S_X86


@dataclass(frozen=True)
class SqsLambda:
    tasks: int
    handler_ms: float
    cap: int
    memory_mb: int
    batch: int = SQS_BATCH
    overhead_ms: float = 0.0

    @property
    def invocations(self) -> int:
        return math.ceil(self.tasks / self.batch)

    @property
    def tasks_per_s(self) -> float:
        return self.cap * 1000.0 / self.handler_ms

    @property
    def drain_s(self) -> float:
        return self.tasks / self.tasks_per_s

    @property
    def gb_s(self) -> float:
        billed_ms = self.tasks * self.handler_ms + self.invocations * self.overhead_ms
        return billed_ms / 1000.0 * self.memory_mb / 1024.0

    @property
    def sqs_requests(self) -> int:
        return self.tasks + 2 * self.invocations  # send per task; receive + delete per batch

    def dollars_per_million_tasks(self, architecture: str) -> dict[str, float]:
        scale = 1_000_000 / self.tasks
        sqs = self.sqs_requests * scale / 1e6 * SQS_STANDARD_PER_MILLION_REQUESTS
        requests = self.invocations * scale / 1e6 * LAMBDA_PER_MILLION_REQUESTS
        duration = self.gb_s * scale * price_per_gb_s(architecture)
        return {"sqs": sqs, "lambda_requests": requests, "lambda_gb_s": duration, "total": sqs + requests + duration}

    def row(self) -> dict[str, Any]:
        return {"tasks_per_s": self.tasks_per_s, "drain_s": self.drain_s,
                "gb_s_per_1000_tasks": self.gb_s * 1000 / self.tasks,
                "requests_per_1000_tasks": self.invocations * 1000 / self.tasks,
                "usd_per_million_x86": self.dollars_per_million_tasks("x86_64"),
                "usd_per_million_arm64": self.dollars_per_million_tasks("arm64")}


def rdq_dollars_per_million_tasks(result: dict[str, Any], architecture: str) -> dict[str, float]:
    """rdq's worker cost per million tasks from a fleet run's report (the database not counted)."""
    tasks = result["scenario"]["tasks"]
    scale = 1_000_000 / tasks
    requests = sum(result["invocations_started"].values()) * scale / 1e6 * LAMBDA_PER_MILLION_REQUESTS
    duration = result["gb_s"] * scale * price_per_gb_s(architecture)
    return {"lambda_requests": requests, "lambda_gb_s": duration, "total": requests + duration}
