"""A vLLM simulator: same OpenAI API, ``vllm:`` metrics and fault injection.

For the demo, tests and benchmarks; never imported by the request path.

    from gateway.sim import SimConfig, SimServerThread, run_sim_server, create_sim_app
"""

from gateway.sim.config import LoraAdapter, ReleaseConfig, SimConfig
from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineEvent, EngineRequest, EngineStats
from gateway.sim.faults import FaultConfig
from gateway.sim.runner import SimServerThread, run_sim_server
from gateway.sim.server import create_sim_app

__all__ = [
    "Engine",
    "EngineEvent",
    "EngineParams",
    "EngineRequest",
    "EngineStats",
    "FaultConfig",
    "LoraAdapter",
    "ReleaseConfig",
    "SimConfig",
    "SimServerThread",
    "create_sim_app",
    "run_sim_server",
]
