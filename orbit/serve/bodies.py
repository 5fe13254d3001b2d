"""The JSON requests of the Tinker wire, one model per request type of the `tinker` SDK 0.38, each
declaring every field the SDK's own type has (tests/test_tinker_fields.py walks the SDK's types
against `REQUESTS`). No field is dropped in silence:
- a field Orbit honours is read by app.py / service.py;
- a field Orbit does not serve is listed in the model's `UNSERVED` with the reason, and a request
  that sets it (to anything but its default) is refused, naming it;
- a field the SDK does not have is refused (`extra="forbid"`), naming it;
- `INFORMATIONAL`: fields that describe the client (its SDK version, telemetry), taken and kept
  nowhere, by design.
The forward_backward request is a protocol buffer (wire.py), not here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, AwareDatetime, BaseModel, ConfigDict, Field

from orbit.serve.futures import Refused

# fields that describe the client, not the work: taken, kept nowhere
INFORMATIONAL = {"sdk_version", "type", "events", "platform", "process_uuid"}


class Body(BaseModel):
    """A request: every field the SDK's type declares; others refused."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    UNSERVED: ClassVar[dict[str, str]] = {}  # field -> why Orbit refuses it when set

    def refuse_unserved(self) -> None:
        for name, why in self.UNSERVED.items():
            value = getattr(self, name)
            if name in self.model_fields_set and value not in (None, False, 0, [], {}):
                raise Refused(f"{name}: {why}")


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class ClientConfig(Body):
    sdk_version: str | None = None


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: str = "create_session"


class SessionHeartbeat(Body):
    session_id: str
    type: str = "session_heartbeat"


class Telemetry(Body):
    events: list[Any] = []
    platform: str | None = None
    sdk_version: str | None = None
    session_id: str | None = None
    process_uuid: str | None = None


class UnloadModel(Body):
    model_id: str
    type: str = "unload_model"


class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: dict[str, Any] | None = None
    type: str = "create_model"


class GetInfo(Body):
    model_id: str
    type: str = "get_info"


class Adam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    # the SDK sends Adam's as adam_params and another family's as optimizer_params
    optim_params: Adam | None = Field(
        None, validation_alias=AliasChoices("optim_params", "adam_params")
    )
    optimizer_params: dict[str, Any] | None = None
    model_id: str
    seq_id: int = 0
    type: str = "optim_step"
    UNSERVED = {"optimizer_params": "Orbit trains with Adam only (adam_params)"}


class SaveWeights(Body):
    model_id: str
    path: str
    seq_id: int = 0
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: str = "save_weights"


class SaveExternal(Body):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    type: str = "save_weights_external"


class SaveForSampler(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int = 0
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: str = "save_weights_for_sampler"


class LoadWeights(Body):
    model_id: str | None = None
    seq_id: int = 0
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, str] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None
    type: str = "load_weights"
    UNSERVED = {
        "weights_access_token": "Orbit's checkpoints are read by their own tenant's key, no tokens"
    }


class CreateSampler(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None
    type: str = "create_sampling_session"


class Chunk(BaseModel):
    model_config = ConfigDict(extra="allow")  # an image chunk's fields: refused by its type
    type: str = "encoded_text"
    tokens: list[int] = []


class Prompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunks: list[Chunk]


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class TensorJson(BaseModel):
    """The SDK's TensorData as JSON: dense `data`, or sparse CSR with the two index lists."""

    model_config = ConfigDict(extra="forbid")
    data: list[int | float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class Sample(Body):
    num_samples: int = 1
    prompt: Prompt
    sampling_params: Sampling = Sampling()
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorJson | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool = False
    type: str = "sample"
    UNSERVED = {
        "base_model": "sample from a sampling session (create_sampling_session names the model)",
        "model_path": "sample from a sampling session (create_sampling_session opens the path)",
        "prompt_alt_tokens_k": "Orbit scores the prompt (prompt_logprobs, topk_prompt_logprobs, "
        "target_prompt_logprobs) but draws no alternatives from it",
    }


class RetrieveFuture(Body):
    request_id: str
    # the SDK lets a server answer a large result's size first; Orbit answers the result itself,
    # which the SDK takes either way
    allow_metadata_only: bool = False


class SetTtl(Body):
    ttl_seconds: int | None = None


class CopyWeights(Body):
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    source_path: str
    ttl_seconds: int | None = None
    weights_access_token: str | None = None
    UNSERVED = {
        "weights_access_token": "a key copies its own checkpoints and those published to it "
        "(publish_checkpoint)"
    }


class StatusQuery(BaseModel):
    """A session status searched for (the SDK's SessionStatusQuery)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1)


class Owner(BaseModel):
    """Whose sessions a search looks at (the SDK's SearchOwner)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class Cursor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    last_created_at: AwareDatetime
    last_session_id: str


class SearchSessions(Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(None, min_length=1)
    owner: Owner = Owner()
    statuses: list[StatusQuery] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: Cursor | None = None


class StorageUsage(Body):
    """Its query parameters (GET, no body)."""

    project_id: str | None = None


# The SDK's request type -> Orbit's model of it, for every request type Orbit serves
REQUESTS: dict[str, type[Body]] = {
    "ClientConfigRequest": ClientConfig,
    "CreateSessionRequest": CreateSession,
    "SessionHeartbeatRequest": SessionHeartbeat,
    "TelemetrySendRequest": Telemetry,
    "UnloadModelRequest": UnloadModel,
    "CreateModelRequest": CreateModel,
    "GetInfoRequest": GetInfo,
    "OptimStepRequest": OptimStep,
    "SaveWeightsRequest": SaveWeights,
    "SaveWeightsForSamplerRequest": SaveForSampler,
    "SaveWeightsExternalRequest": SaveExternal,
    "LoadWeightsRequest": LoadWeights,
    "CreateSamplingSessionRequest": CreateSampler,
    "SampleRequest": Sample,
    "FutureRetrieveRequest": RetrieveFuture,
    "SessionSearchRequest": SearchSessions,
    "CopyWeightsRequest": CopyWeights,
    "GetCurrentCheckpointStorageUsageRequest": StorageUsage,
}

# The SDK's routes Orbit does not serve: (method, route under /api/v1, the SDK's request type if it
# has one, why); each answers 400 with the reason (the SDK retries any 5xx for minutes)
NOT_SERVED: list[tuple[str, str, str, str]] = [
    (
        "POST",
        "/create_custom_loss",
        "CreateCustomLossRequest",
        "Orbit computes its built-in losses",
    ),
    ("POST", "/retrieve_futures", "FuturesRetrieveRequest", "poll each with retrieve_future"),
    ("POST", "/cancel_future", "", "a request Orbit queued runs to its end"),
    (
        "POST",
        "/join_sampling_session",
        "JoinSamplingSessionRequest",
        "a sampling session is used by the client that made it",
    ),
    ("GET", "/billing/usage/events", "GetBillingUsageRequest", "Orbit bills nobody"),
    ("GET", "/sessions/{session}/trace_export", "", "Orbit records no traces"),
    ("GET", "/audit", "", "Orbit keeps no audit log"),
    ("GET", "/auth/token", "", "Orbit takes its keys as they are (X-API-Key)"),
]
