"""Configuration of one simulated vLLM server (``SimConfig``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.sim.engine import EngineParams
from gateway.sim.faults import FaultConfig
from gateway.sim.gpu import GpuConfig


class LoraAdapter(BaseModel):
    """An extra served model id: a LoRA adapter on a parent model.

    Listed by ``/v1/models`` with ``parent`` (default: the base model) and ``root``
    (``path``, default ``/adapters/<name>``), as vLLM lists ``--lora-modules``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    parent: str | None = None
    path: str | None = None


class SimConfig(BaseModel):
    """Everything one simulated vLLM server needs.

    ``engine`` holds capacity and speed (seconds, tokens), ``faults`` the injected
    faults, ``seed`` the default seed of generated text (a request's ``seed`` wins).
    With ``api_key`` set, routes under ``/v1`` (and ``/v2``, ``/inference``,
    ``/cohere``, as vLLM's ``AuthenticationMiddleware``) need
    ``Authorization: Bearer <key>``.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = "demo-model"
    model_root: str | None = Field(None, description="'root' of the base model in /v1/models")
    lora_adapters: list[LoraAdapter] = Field(default_factory=list)
    seed: int = 0
    engine: EngineParams = Field(default_factory=EngineParams)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig, description="GPUs behind /gpu/metrics")
    api_key: str | None = None
    embedding_dim: int = Field(64, ge=1)
    request_overhead_s: float = Field(
        0.0,
        ge=0,
        description="s of API-server time per /v1/embeddings request, one at a time: vLLM's "
        "single frontend process parses, tokenizes and serialises each HTTP request (the CPU "
        "bottleneck of small embeddings, vllm-project/vllm#11320, #22941); 0: not modelled. "
        "Measured on vLLM 0.32.0's CPU build: 1.08 ms (benchmarks/embed_merge_real.py --costs)",
    )
    input_overhead_s: float = Field(
        0.0,
        ge=0,
        description="s of API-server time per input of a /v1/embeddings request, added to "
        "request_overhead_s (vLLM makes one engine request per input and serialises each "
        "vector). Measured on vLLM 0.32.0's CPU build: 0.50 ms",
    )
    engine_label: str = Field("0", description="value of the 'engine' metric label")
    vllm_version: str = Field("0.32.0", description="reported by /version and fingerprints")
    stop_length_min: int = Field(4, ge=1, description="shortest natural (EOS) length, tokens")
    stop_length_max: int = Field(512, ge=1, description="longest natural (EOS) length, tokens")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        names = [self.model, *(a.name for a in self.lora_adapters)]
        if len(set(names)) != len(names):
            raise ValueError(f"served model ids must be unique: {names}")
        if self.stop_length_min > self.stop_length_max:
            raise ValueError("stop_length_min must be <= stop_length_max")
        return self

    @property
    def served_ids(self) -> list[str]:
        """Every model id this server answers to: the base model, then the adapters."""
        return [self.model, *(a.name for a in self.lora_adapters)]
