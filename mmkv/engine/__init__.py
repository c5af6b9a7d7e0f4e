"""The engine: continuous batching over spliced sequences, the shape nano-vllm and mini-sglang use.

``Request`` (the record per request) -> ``Scheduler`` (waiting, prefilling, running; admission by
``max_batch`` and KV bytes) -> ``ModelRunner`` (a prefill in chunks with its splices and repairs; one batched
decode forward, ``DecodeBatch``) -> ``EngineCore.step()`` (schedule -> run -> postprocess). The server's model
thread steps one core for every request; a ``Session`` steps its own for its one sequence.
"""

from .batch import DecodeBatch
from .core import ALONE, EngineCore, run_alone
from .events import Delta, Done, Event, Failed, First, Started
from .request import Request, Status
from .runner import ModelRunner
from .scheduler import EngineConfig, QueueFull, Scheduler, StepPlan

__all__ = [
    "ALONE",
    "DecodeBatch",
    "Delta",
    "Done",
    "EngineConfig",
    "EngineCore",
    "Event",
    "Failed",
    "First",
    "ModelRunner",
    "QueueFull",
    "Request",
    "Scheduler",
    "Started",
    "Status",
    "StepPlan",
    "run_alone",
]
