"""Serving integration: a scheduler, the checksum model and standard workloads.

This is how radixcache is driven in a serving engine, end to end, with a stand-in model
that makes any cache mistake visible:

* `ChecksumModel` — a deterministic hybrid "model" that writes and reads real `Storage`
  (every layer of K, V, conv and SSM, and of SWA K and V: `MODELS`); its samples depend
  on every KV entry a request reads and on its state, and `Reference` gives the samples
  computed without a cache.
* `Scheduler` — continuous batching over the request API: admission first come, first
  served or longest cached prefix first (`SCHEDULE_POLICIES`), with copy-on-write and
  load-back, chunked prefill cut and checkpointed at the branch point, batched
  decode, retraction under memory pressure, a compute event per step for the engine.
* Workloads — ``gsp``, ``multiturn`` and ``mixed`` (built in, seeded) and JSONL files.
* `replay` — all of it, with a report (what ``radixcache replay`` prints).
"""

from .harness import ReplayConfig, attention_only_hit_rate, clear, replay
from .model import MODELS, ChecksumModel, ComputeEvent, ComputeStream, Reference, model_name
from .scheduler import (
    SCHEDULE_POLICIES,
    CopyFailed,
    FaultyEngine,
    InstantEngine,
    Refused,
    Scheduler,
    StepSample,
)
from .workloads import WORKLOADS, Job, gsp, load, load_jsonl, mixed, multiturn, save_jsonl

__all__ = [
    "MODELS",
    "SCHEDULE_POLICIES",
    "WORKLOADS",
    "ChecksumModel",
    "ComputeEvent",
    "ComputeStream",
    "CopyFailed",
    "FaultyEngine",
    "InstantEngine",
    "Job",
    "Reference",
    "Refused",
    "ReplayConfig",
    "Scheduler",
    "StepSample",
    "attention_only_hit_rate",
    "clear",
    "gsp",
    "load",
    "load_jsonl",
    "mixed",
    "model_name",
    "multiturn",
    "replay",
    "save_jsonl",
]
