from pagoda.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenIdsInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "stopping", "priority", "cache_salt", "skip_special_tokens", "resume", "structured", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIdsInput
    chat: ChatInput
    sampling: _common_pb2.SamplingParams
    stopping: StoppingCriteria
    priority: int
    cache_salt: str
    skip_special_tokens: bool
    resume: ResumeFrom
    structured: _common_pb2.StructuredOutput
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIdsInput, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., skip_special_tokens: _Optional[bool] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ..., structured: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., lora: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("request_id", "delivered_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delivered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., delivered_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_offloaded")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_offloaded: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_offloaded: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ns", "time_to_first_token_ns", "total_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    time_to_first_token_ns: int
    total_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., time_to_first_token_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "usage", "timings", "prompt_token_ids", "output_index", "seed", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.LogprobEntry]
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    timings: Timings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_index: int
    seed: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.LogprobEntry]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.LogprobEntry, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_index: _Optional[int] = ..., seed: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.LogprobEntry, _Mapping]]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("stream", "generate", "cancel", "timeout_s", "traceparent")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    stream: int
    generate: GenerateRequest
    cancel: bool
    timeout_s: float
    traceparent: str
    def __init__(self, stream: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., traceparent: _Optional[str] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("stream", "response", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    response: GenerateResponse
    end: StreamEnd
    def __init__(self, stream: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class StreamResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[StreamResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[StreamResponse, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "dtype", "max_model_len", "vocab_size", "eos_token_ids", "has_chat_template", "max_prompt_tokens", "max_new_tokens", "kv_cache_dtype", "quantization", "batch_invariant", "loras")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    max_prompt_tokens: int
    max_new_tokens: int
    kv_cache_dtype: str
    quantization: str
    batch_invariant: bool
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapter]
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., loras: _Optional[_Iterable[_Union[_common_pb2.LoraAdapter, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatInput
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorStatus(_message.Message):
    __slots__ = ("address", "incarnation_id", "state", "num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks", "kv_cache_usage", "kernels", "lease_holder", "lease_epoch", "kv_offload", "num_tier_blocks", "kv_cache_dtype", "quantization", "draft_model", "batch_invariant", "loras", "tensor_parallel_size", "pipeline_parallel_size", "group_ranks", "group_last_contact_s")
    class KernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_LAST_CONTACT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    incarnation_id: str
    state: str
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    kernels: _containers.ScalarMap[str, str]
    lease_holder: str
    lease_epoch: int
    kv_offload: str
    num_tier_blocks: int
    kv_cache_dtype: str
    quantization: str
    draft_model: str
    batch_invariant: bool
    loras: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    group_ranks: _containers.RepeatedCompositeFieldContainer[GroupRankStatus]
    group_last_contact_s: float
    def __init__(self, address: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., state: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., kernels: _Optional[_Mapping[str, str]] = ..., lease_holder: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., kv_offload: _Optional[str] = ..., num_tier_blocks: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., draft_model: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., loras: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., group_ranks: _Optional[_Iterable[_Union[GroupRankStatus, _Mapping]]] = ..., group_last_contact_s: _Optional[float] = ...) -> None: ...

class GroupRankStatus(_message.Message):
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

class ServerStatus(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "executors", "num_requests_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total", "scheduler_id", "schedulers", "spec_num_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total", "offload_hit_tokens_total", "num_swaps_total", "spec_model_num_drafts_total", "spec_model_draft_tokens_total", "spec_model_accepted_tokens_total")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODEL_NUM_DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODEL_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODEL_ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStatus]
    num_requests_total: int
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    scheduler_id: str
    schedulers: _containers.RepeatedScalarFieldContainer[str]
    spec_num_drafts_total: int
    spec_draft_tokens_total: int
    spec_accepted_tokens_total: int
    offload_hit_tokens_total: int
    num_swaps_total: int
    spec_model_num_drafts_total: int
    spec_model_draft_tokens_total: int
    spec_model_accepted_tokens_total: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., executors: _Optional[_Iterable[_Union[ExecutorStatus, _Mapping]]] = ..., num_requests_total: _Optional[int] = ..., num_preemptions_total: _Optional[int] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., scheduler_id: _Optional[str] = ..., schedulers: _Optional[_Iterable[str]] = ..., spec_num_drafts_total: _Optional[int] = ..., spec_draft_tokens_total: _Optional[int] = ..., spec_accepted_tokens_total: _Optional[int] = ..., offload_hit_tokens_total: _Optional[int] = ..., num_swaps_total: _Optional[int] = ..., spec_model_num_drafts_total: _Optional[int] = ..., spec_model_draft_tokens_total: _Optional[int] = ..., spec_model_accepted_tokens_total: _Optional[int] = ...) -> None: ...
