"""Engine wing: the minimal batch runner behind `python -m compile` (request slots, page
allocation, chunked prefill, decode, sampling) and its CLI helpers. The top of the import graph."""

from compile.engine.engine import Engine, EngineStats, Req
from compile.engine.sampling import SamplingParams, sample

__all__ = ["Engine", "EngineStats", "Req", "SamplingParams", "sample"]
