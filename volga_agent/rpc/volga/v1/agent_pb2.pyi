from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    HOT: _ClassVar[Tier]
    WARM: _ClassVar[Tier]
    SUSPENDED: _ClassVar[Tier]
    FROZEN: _ClassVar[Tier]
    COLD: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
HOT: Tier
WARM: Tier
SUSPENDED: Tier
FROZEN: Tier
COLD: Tier

class ActivateRequest(_message.Message):
    __slots__ = ("model_id", "instance", "device_hint", "timeout_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    instance: str
    device_hint: str
    timeout_ms: int
    def __init__(self, model_id: _Optional[str] = ..., instance: _Optional[str] = ..., device_hint: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ActivateResponse(_message.Message):
    __slots__ = ("instance", "woke_from", "wake_ms", "fallback", "also")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    WOKE_FROM_FIELD_NUMBER: _ClassVar[int]
    WAKE_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    instance: Instance
    woke_from: Tier
    wake_ms: float
    fallback: bool
    also: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, instance: _Optional[_Union[Instance, _Mapping]] = ..., woke_from: _Optional[_Union[Tier, str]] = ..., wake_ms: _Optional[float] = ..., fallback: _Optional[bool] = ..., also: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    def __init__(self, instance: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "product", "memory_total_bytes", "memory_used_bytes", "driver", "pci_bus_id", "numa_node")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PRODUCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    product: str
    memory_total_bytes: int
    memory_used_bytes: int
    driver: str
    pci_bus_id: str
    numa_node: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., product: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., driver: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node", "gpus", "host_memory_budget_bytes", "host_memory_used_bytes", "snapshot_disk_budget_bytes", "snapshot_disk_used_bytes", "activations", "restore_failures", "evictions", "circuit_open")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_OPEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    host_memory_budget_bytes: int
    host_memory_used_bytes: int
    snapshot_disk_budget_bytes: int
    snapshot_disk_used_bytes: int
    activations: int
    restore_failures: int
    evictions: int
    circuit_open: bool
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., host_memory_budget_bytes: _Optional[int] = ..., host_memory_used_bytes: _Optional[int] = ..., snapshot_disk_budget_bytes: _Optional[int] = ..., snapshot_disk_used_bytes: _Optional[int] = ..., activations: _Optional[int] = ..., restore_failures: _Optional[int] = ..., evictions: _Optional[int] = ..., circuit_open: _Optional[bool] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("name", "model_id", "model_version", "tier", "device", "socket", "node", "snapshot_bytes", "last_used_unix", "last_wake_ms", "input_hash", "state_reason", "warmup_reported", "warmup_skipped", "output_mismatch", "answered_outputs", "source", "source_digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_WAKE_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    WARMUP_REPORTED_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_id: str
    model_version: str
    tier: Tier
    device: str
    socket: str
    node: str
    snapshot_bytes: int
    last_used_unix: float
    last_wake_ms: float
    input_hash: str
    state_reason: str
    warmup_reported: bool
    warmup_skipped: str
    output_mismatch: str
    answered_outputs: _containers.RepeatedCompositeFieldContainer[TensorShape]
    source: str
    source_digest: str
    def __init__(self, name: _Optional[str] = ..., model_id: _Optional[str] = ..., model_version: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., device: _Optional[str] = ..., socket: _Optional[str] = ..., node: _Optional[str] = ..., snapshot_bytes: _Optional[int] = ..., last_used_unix: _Optional[float] = ..., last_wake_ms: _Optional[float] = ..., input_hash: _Optional[str] = ..., state_reason: _Optional[str] = ..., warmup_reported: _Optional[bool] = ..., warmup_skipped: _Optional[str] = ..., output_mismatch: _Optional[str] = ..., answered_outputs: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., source: _Optional[str] = ..., source_digest: _Optional[str] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("model_id", "arrivals", "completed", "queue_depth", "latencies_ms", "shed")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LATENCIES_MS_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    arrivals: int
    completed: int
    queue_depth: int
    latencies_ms: _containers.RepeatedScalarFieldContainer[float]
    shed: int
    def __init__(self, model_id: _Optional[str] = ..., arrivals: _Optional[int] = ..., completed: _Optional[int] = ..., queue_depth: _Optional[int] = ..., latencies_ms: _Optional[_Iterable[float]] = ..., shed: _Optional[int] = ...) -> None: ...

class ExchangeLoadRequest(_message.Message):
    __slots__ = ("loads",)
    LOADS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    def __init__(self, loads: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ...) -> None: ...

class ExchangeLoadResponse(_message.Message):
    __slots__ = ("autonomy", "batch_caps", "shed_retry_after_ms", "period_ms", "state", "neighbours")
    class BatchCapsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ShedRetryAfterMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    AUTONOMY_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAPS_FIELD_NUMBER: _ClassVar[int]
    SHED_RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    PERIOD_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    autonomy: bool
    batch_caps: _containers.ScalarMap[str, int]
    shed_retry_after_ms: _containers.ScalarMap[str, int]
    period_ms: int
    state: str
    neighbours: _containers.RepeatedCompositeFieldContainer[NodeLevel]
    def __init__(self, autonomy: _Optional[bool] = ..., batch_caps: _Optional[_Mapping[str, int]] = ..., shed_retry_after_ms: _Optional[_Mapping[str, int]] = ..., period_ms: _Optional[int] = ..., state: _Optional[str] = ..., neighbours: _Optional[_Iterable[_Union[NodeLevel, _Mapping]]] = ...) -> None: ...

class ModelLevel(_message.Message):
    __slots__ = ("model_id", "hot", "shed")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HOT_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    hot: bool
    shed: bool
    def __init__(self, model_id: _Optional[str] = ..., hot: _Optional[bool] = ..., shed: _Optional[bool] = ...) -> None: ...

class NodeLevel(_message.Message):
    __slots__ = ("node", "state", "memory_pct", "load", "models", "sequence", "gateway", "age_ms", "gateway_http")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PCT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_HTTP_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: str
    memory_pct: float
    load: float
    models: _containers.RepeatedCompositeFieldContainer[ModelLevel]
    sequence: int
    gateway: str
    age_ms: int
    gateway_http: str
    def __init__(self, node: _Optional[str] = ..., state: _Optional[str] = ..., memory_pct: _Optional[float] = ..., load: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelLevel, _Mapping]]] = ..., sequence: _Optional[int] = ..., gateway: _Optional[str] = ..., age_ms: _Optional[int] = ..., gateway_http: _Optional[str] = ...) -> None: ...
