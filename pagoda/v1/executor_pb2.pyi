from pagoda.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ("num_running",)
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    def __init__(self, num_running: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("scheduler_id", "draining", "brief")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    draining: bool
    brief: bool
    def __init__(self, scheduler_id: _Optional[str] = ..., draining: _Optional[bool] = ..., brief: _Optional[bool] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("scheduler_id",)
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    def __init__(self, scheduler_id: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("granted", "epoch", "holder_id")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    epoch: int
    holder_id: str
    def __init__(self, granted: _Optional[bool] = ..., epoch: _Optional[int] = ..., holder_id: _Optional[str] = ...) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("incarnation_id", "model_name", "architecture", "dtype", "kv_cache_dtype", "device", "block_size", "num_kv_blocks", "max_model_len", "vocab_size", "eos_token_ids", "tokenizer_json", "chat_template", "bos_token", "eos_token", "draining", "kernels", "lease_holder", "lease_epoch", "schedulers", "lease_claimants", "kv_offload", "tier_hashes", "quantization", "draft_model", "kv_cache_bytes", "draft_kv_cache_bytes", "rope_switch_len", "batch_invariant", "loras", "max_loras", "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size", "group_ranks", "group_last_contact_s", "compact_steps")
    class KernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_CLAIMANTS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    TIER_HASHES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROPE_SWITCH_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_LAST_CONTACT_S_FIELD_NUMBER: _ClassVar[int]
    COMPACT_STEPS_FIELD_NUMBER: _ClassVar[int]
    incarnation_id: str
    model_name: str
    architecture: str
    dtype: str
    kv_cache_dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    draining: bool
    kernels: _containers.ScalarMap[str, str]
    lease_holder: str
    lease_epoch: int
    schedulers: _containers.RepeatedScalarFieldContainer[str]
    lease_claimants: _containers.RepeatedScalarFieldContainer[str]
    kv_offload: str
    tier_hashes: _containers.RepeatedScalarFieldContainer[int]
    quantization: str
    draft_model: str
    kv_cache_bytes: int
    draft_kv_cache_bytes: int
    rope_switch_len: int
    batch_invariant: bool
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapter]
    max_loras: int
    max_lora_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    group_ranks: _containers.RepeatedCompositeFieldContainer[GroupRank]
    group_last_contact_s: float
    compact_steps: bool
    def __init__(self, incarnation_id: _Optional[str] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., draining: _Optional[bool] = ..., kernels: _Optional[_Mapping[str, str]] = ..., lease_holder: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., schedulers: _Optional[_Iterable[str]] = ..., lease_claimants: _Optional[_Iterable[str]] = ..., kv_offload: _Optional[str] = ..., tier_hashes: _Optional[_Iterable[int]] = ..., quantization: _Optional[str] = ..., draft_model: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., draft_kv_cache_bytes: _Optional[int] = ..., rope_switch_len: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., loras: _Optional[_Iterable[_Union[_common_pb2.LoraAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., group_ranks: _Optional[_Iterable[_Union[GroupRank, _Mapping]]] = ..., group_last_contact_s: _Optional[float] = ..., compact_steps: _Optional[bool] = ...) -> None: ...

class GroupRank(_message.Message):
    __slots__ = ("rank", "host", "pid", "shard", "rss_bytes", "kv_cache_bytes", "health")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    pid: int
    shard: str
    rss_bytes: int
    kv_cache_bytes: int
    health: str
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., shard: _Optional[str] = ..., rss_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., health: _Optional[str] = ...) -> None: ...

class BlockLoad(_message.Message):
    __slots__ = ("block_hash", "block_id")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    block_id: int
    def __init__(self, block_hash: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class BlockSave(_message.Message):
    __slots__ = ("block_id", "block_hash", "token_ids")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_id: _Optional[int] = ..., block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "structured", "traceparent", "loads", "long_rope", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LONG_ROPE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    structured: _common_pb2.StructuredOutput
    traceparent: str
    loads: _containers.RepeatedCompositeFieldContainer[BlockLoad]
    long_rope: bool
    lora_name: str
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., structured: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., traceparent: _Optional[str] = ..., loads: _Optional[_Iterable[_Union[BlockLoad, _Mapping]]] = ..., long_rope: _Optional[bool] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "num_scheduled_tokens", "new_block_ids", "draft_token_ids", "num_model_draft_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_model_draft_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_model_draft_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_seqs", "scheduled_seqs", "dropped_seq_ids", "epoch", "saves", "compact_seq_ids", "compact_num_tokens", "compact_results")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_SEQS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    COMPACT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_RESULTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled_seqs: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    dropped_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    saves: _containers.RepeatedCompositeFieldContainer[BlockSave]
    compact_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    compact_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    compact_results: bool
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled_seqs: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., dropped_seq_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., saves: _Optional[_Iterable[_Union[BlockSave, _Mapping]]] = ..., compact_seq_ids: _Optional[_Iterable[int]] = ..., compact_num_tokens: _Optional[_Iterable[int]] = ..., compact_results: _Optional[bool] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs", "prompt_logprobs", "prompt_logprobs_start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.LogprobEntry]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.LogprobEntry]
    prompt_logprobs_start: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.LogprobEntry, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.LogprobEntry, _Mapping]]] = ..., prompt_logprobs_start: _Optional[int] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("seq_id", "message", "missing_block_hashes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    message: str
    missing_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., message: _Optional[str] = ..., missing_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_ns", "forward_ns", "sample_ns", "step_ns", "idle_ns", "load_ns", "save_ns", "draft_ns")
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    SAVE_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    step_ns: int
    idle_ns: int
    load_ns: int
    save_ns: int
    draft_ns: int
    def __init__(self, prepare_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., step_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., load_ns: _Optional[int] = ..., save_ns: _Optional[int] = ..., draft_ns: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "incarnation_id", "outputs", "errors", "timings", "num_scheduled_tokens", "draining", "tier_added", "tier_removed", "tier_reset", "compact_seq_ids", "compact_num_tokens", "compact_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TIER_ADDED_FIELD_NUMBER: _ClassVar[int]
    TIER_REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_RESET_FIELD_NUMBER: _ClassVar[int]
    COMPACT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    incarnation_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    errors: _containers.RepeatedCompositeFieldContainer[SequenceError]
    timings: StepTimings
    num_scheduled_tokens: int
    draining: bool
    tier_added: _containers.RepeatedScalarFieldContainer[int]
    tier_removed: _containers.RepeatedScalarFieldContainer[int]
    tier_reset: bool
    compact_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    compact_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    compact_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., incarnation_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[SequenceError, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., num_scheduled_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., tier_added: _Optional[_Iterable[int]] = ..., tier_removed: _Optional[_Iterable[int]] = ..., tier_reset: _Optional[bool] = ..., compact_seq_ids: _Optional[_Iterable[int]] = ..., compact_num_tokens: _Optional[_Iterable[int]] = ..., compact_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
