"""A resumed request continues the fault-free stream exactly; bad resume input is refused and changes nothing.

The Engine runs for real (validation, admission, replay, the scheduler core,
the output processor); only the executor is a script: the token at output
position i is ``SCRIPT[i]`` with logprob ``-i``, so the fault-free stream is
known and every resume point can be tried. The script's text has multi-byte
characters split over byte-level tokens and stop strings that span many tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from scheduler.test_detokenizer import train_tiny_tokenizer, train_tiny_tokenizer_json

from pagoda.step import ExecutorInfo, FinishReason, LogprobEntry, SeqOutput, StepPlan, StepResult, TokenLogprob
from pagoda.v1 import generation_pb2
from scheduler_svc.api import convert as client_pb_convert
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorState
from scheduler_svc.request import GenerationRequest, PromptInput, RequestOutput, ResumeFrom

TOKENIZER = train_tiny_tokenizer()
VOCAB = TOKENIZER.vocab_size
EOS_ID = 0  # <|endoftext|>
TEXT = "héllo wörld 🎉 the quick brown fox, STOP here; 世界 and more text after it"
SCRIPT = TOKENIZER.encode(TEXT, add_special_tokens=False)
PROMPT = tuple(TOKENIZER.encode("A prompt: ", add_special_tokens=False))
MAX_MODEL_LEN = 256
INFO = ExecutorInfo(
    incarnation_id="scripted",
    model_name="tiny",
    architecture="LlamaForCausalLM",
    dtype="float32",
    kv_cache_dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=128,
    max_model_len=MAX_MODEL_LEN,
    vocab_size=TOKENIZER.vocab_size,
    eos_token_ids=(EOS_ID,),
    tokenizer_json=train_tiny_tokenizer_json(),
    chat_template="",
    bos_token="",
    eos_token="",
)
# Sampling and stopping of each case; the fault-free stream of each ends differently.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "length": ({"temperature": 0.8, "seed": 7}, {"max_tokens": len(SCRIPT) - 3}),
    "stop-string": ({"seed": 7, "logprobs": 0}, {"stop": ["wörld 🎉 t", "nothing"], "max_tokens": len(SCRIPT)}),
    "stop-string-kept": ({"seed": 7}, {"stop": ["STOP"], "include_stop_str_in_output": True, "max_tokens": 99}),
    "stop-token": ({"seed": 7}, {"stop_token_ids": [SCRIPT[20]], "max_tokens": 99}),
}


class ScriptedExecutor:
    """Follows plans like an executor; samples SCRIPT[output position] (EOS past its end)."""

    def __init__(self) -> None:
        # seq_id -> [token ids, num prompt tokens, num computed]
        self.seqs: dict[int, list[Any]] = {}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.dropped_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = [list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens]
        work = [(s.seq_id, s.num_scheduled_tokens) for s in (*plan.new_seqs, *plan.scheduled_seqs)]
        outputs = [out for seq_id, n in work if (out := self._run(seq_id, n)) is not None]
        return StepResult(plan.step_id, "scripted", tuple(outputs), num_scheduled_tokens=plan.num_scheduled_tokens)

    def _run(self, seq_id: int, num_tokens: int) -> SeqOutput | None:
        held = self.seqs[seq_id]
        held[2] += num_tokens
        if held[2] < len(held[0]):
            return None
        position = len(held[0]) - held[1]
        token = SCRIPT[position] if position < len(SCRIPT) else EOS_ID
        held[0].append(token)
        return SeqOutput(seq_id, (token,), (LogprobEntry(TokenLogprob(token, -float(position))),))


@dataclasses.dataclass
class System:
    """An Engine with one executor handle whose steps the test drives."""

    engine: Engine
    handle: ExecutorHandle
    scheduler: Scheduler
    executor: ScriptedExecutor

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.has_work or plan.dropped_seq_ids:
            result = self.executor.execute(plan)
            self.engine.on_updates(self.handle, self.scheduler.update(result), result)


def _system() -> System:
    engine = Engine(SchedulerServiceConfig(max_new_tokens=200))
    config = SchedulerConfig(num_blocks=INFO.num_kv_blocks, block_size=INFO.block_size, eos_token_ids=(EOS_ID,))
    handle = ExecutorHandle("scripted:1", engine, lambda info: config, step_timeout_s=1.0)
    handle.info, handle.scheduler, handle.state = INFO, Scheduler(config), ExecutorState.READY
    engine.executors[handle.address] = handle
    assert engine.on_executor_described(handle, INFO)
    engine.on_executor_ready(handle, INFO)
    return System(engine, handle, handle.scheduler, ScriptedExecutor())


def _request(
    sampling: Mapping[str, Any], stopping: Mapping[str, Any], delivered: tuple[int, ...] | None = None, **kw: Any
) -> GenerationRequest:
    resume = None if delivered is None else ResumeFrom("req-1", delivered)
    fields: dict[str, Any] = {"prompt": PromptInput(token_ids=PROMPT), "resume": resume, **kw}
    return GenerationRequest("req-1", sampling=sampling, stopping=stopping, **fields)


async def _generate(system: System, request: GenerationRequest) -> list[RequestOutput]:
    """Every output of one request, the test stepping the executor meanwhile."""

    async def steps() -> None:
        while True:
            system.step()
            await asyncio.sleep(0)

    stepping = asyncio.create_task(steps())
    try:
        return [out async for out in system.engine.generate(request)]
    finally:
        stepping.cancel()


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(out.text for out in outputs)


def _token_ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def _logprobs(outputs: list[RequestOutput]) -> list[float]:
    return [entry.sampled.logprob for out in outputs for entry in out.logprobs]


@pytest.mark.parametrize("case", CASES)
async def test_a_resume_at_every_point_continues_the_fault_free_stream(case):
    sampling, stopping = CASES[case]
    fault_free = await _generate(_system(), _request(sampling, stopping))
    tokens = _token_ids(fault_free)
    assert fault_free[-1].finished and len(tokens) >= 15
    assert [out.output_index for out in fault_free] == list(range(len(tokens)))  # one token per step here
    for k in range(len(tokens) + 1):
        system = _system()
        resumed = await _generate(system, _request(sampling, stopping, delivered=tuple(tokens[:k])))
        assert _token_ids(fault_free[:k]) + _token_ids(resumed) == tokens, k
        assert _text(fault_free[:k]) + _text(resumed) == _text(fault_free), k
        assert _logprobs(fault_free[:k]) + _logprobs(resumed) == _logprobs(fault_free), k
        last, first = resumed[-1], resumed[0]
        assert (last.finish_reason, last.stop_reason, last.usage) == (
            fault_free[-1].finish_reason,
            fault_free[-1].stop_reason,
            fault_free[-1].usage,
        ), k
        assert (first.output_index, first.seed, first.prompt_token_ids) == (k, 7, PROMPT)
        assert all(out.seed is None and not out.prompt_token_ids for out in resumed[1:])
        assert not system.scheduler.has_unfinished() and not system.engine._requests


async def test_the_resumed_sequence_starts_with_the_delivered_outputs():
    system = _system()
    delivered = tuple(SCRIPT[:9])
    outputs = await _generate(system, _request({"seed": 11}, {"max_tokens": 12}, delivered=delivered))
    new = system.executor.plans[0].new_seqs[0]
    assert (new.token_ids, new.num_prompt_tokens, new.sampling.seed) == (PROMPT + delivered, len(PROMPT), 11)
    assert _token_ids(outputs) == SCRIPT[9:12]
    assert outputs[-1].usage.completion_tokens == 12 and outputs[-1].usage.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize(
    "delivered,stopping,reason,stop_reason",
    [
        ((*SCRIPT[:5], EOS_ID), {}, FinishReason.STOP, None),
        (tuple(SCRIPT[:6]), {"stop_token_ids": [SCRIPT[5]]}, FinishReason.STOP, SCRIPT[5]),
        (tuple(SCRIPT[:6]), {"max_tokens": 6}, FinishReason.LENGTH, None),
        (tuple(SCRIPT[:16]), {"stop": ["wörld"]}, FinishReason.STOP, "wörld"),
    ],
    ids=["eos", "stop-token", "max-tokens", "stop-string"],
)
async def test_delivered_tokens_that_end_the_request_answer_at_once(delivered, stopping, reason, stop_reason):
    system = _system()
    outputs = await _generate(system, _request({"seed": 1}, stopping, delivered=delivered))
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("", (), reason, stop_reason)
    assert (out.output_index, out.seed, out.usage.completion_tokens) == (len(delivered), 1, len(delivered))
    assert system.executor.plans == [] and not system.scheduler.has_unfinished()


CONTEXT_PROMPT = tuple(SCRIPT[:30]) * 8  # 240 tokens of the 256-token context
BAD_RESUMES = [
    (
        {"delivered": (5, VOCAB)},
        f"resume.delivered_token_ids: token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
    ),
    ({"delivered": (5, -1)}, f"resume.delivered_token_ids: token id -1 is outside the vocabulary [0, {VOCAB})"),
    (
        {"delivered": tuple(SCRIPT[:5]), "stopping": {"max_tokens": 4}},
        "resume.delivered_token_ids: 5 delivered tokens, more than max_tokens (4)",
    ),
    (
        {"delivered": tuple(SCRIPT[:20]), "prompt": PromptInput(token_ids=CONTEXT_PROMPT), "stopping": {}},
        "resume.delivered_token_ids: prompt (240 tokens) + delivered (20 tokens) exceeds the model's context of 256",
    ),
    ({"delivered": (5,) * 201}, "resume.delivered_token_ids: at most 200 token ids, got 201"),
    ({"resume_id": ""}, "resume.request_id: must have 1 to 256 characters"),
    ({"resume_id": "r" * 257}, "resume.request_id: must have 1 to 256 characters"),
    ({"resume_id": "other"}, "resume.request_id: must equal the request's id 'req-1'"),
    ({"sampling": {"temperature": 0.8}}, "sampling.seed: required with resume: the seed of the request's first"),
]


@pytest.mark.parametrize("bad,message", BAD_RESUMES)
async def test_bad_resume_input_names_the_field_and_harms_nothing(bad, message):
    system = _system()
    expected = await _generate(_system(), _request({"seed": 3}, {"max_tokens": 24}))
    running = system.engine.generate(_request({"seed": 3}, {"max_tokens": 24}))
    outputs = [await _next(system, running)]  # another request, admitted and streaming
    before = (system.scheduler.kv.num_free_blocks, system.engine.num_running, system.engine.num_waiting)
    resume = ResumeFrom(bad.get("resume_id", "req-1"), bad.get("delivered", (5,)))
    request = dataclasses.replace(
        _request(bad.get("sampling", {"seed": 3}), bad.get("stopping", {"max_tokens": 24})),
        prompt=bad.get("prompt", PromptInput(token_ids=PROMPT)),
        resume=resume,
    )
    with pytest.raises(InvalidRequest) as caught:
        await anext(system.engine.generate(request))
    assert str(caught.value).startswith(message)
    assert caught.value.field == message.split(":")[0]
    after = (system.scheduler.kv.num_free_blocks, system.engine.num_running, system.engine.num_waiting)
    assert after == before and len(system.engine._requests) == 1
    while not outputs[-1].finished:
        outputs.append(await _next(system, running))
    assert _token_ids(outputs) == _token_ids(expected) and _text(outputs) == _text(expected)


async def _next(system: System, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The next output of a running request, the test stepping the executor until it comes."""
    waiting = asyncio.ensure_future(anext(outputs))
    while not waiting.done():
        system.step()
        await asyncio.sleep(0)
    return waiting.result()


def test_resume_and_the_new_response_fields_cross_the_client_edge():
    msg = generation_pb2.GenerateRequest(request_id="r-9", token_ids=generation_pb2.TokenIdsInput(token_ids=[1, 2]))
    assert client_pb_convert.request_from_pb(msg, "r-9", None).resume is None
    msg.resume.request_id = "r-9"
    msg.resume.delivered_token_ids.extend([4, 5, 6])
    assert client_pb_convert.request_from_pb(msg, "r-9", None).resume == ResumeFrom("r-9", (4, 5, 6))
    first = client_pb_convert.output_to_pb(RequestOutput("r-9", "a", (7,), output_index=3, seed=2**63 - 1))
    later = client_pb_convert.output_to_pb(RequestOutput("r-9", "b", (8,), output_index=4))
    assert (first.output_index, first.HasField("seed"), first.seed) == (3, True, 2**63 - 1)
    assert (later.output_index, later.HasField("seed")) == (4, False)


async def _generate_slowly(system: System, request: GenerationRequest, steps_per_read: int) -> list[RequestOutput]:
    """Every output of one request read by a stream that runs only every `steps_per_read` steps."""
    outputs: list[RequestOutput] = []
    stream = system.engine.generate(request)
    try:
        while not outputs or not outputs[-1].finished:
            reading = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # the stream waits (the first time: the request is admitted)
            for _ in range(steps_per_read):
                system.step()  # synchronous: the stream cannot read in between
            outputs.append(await asyncio.wait_for(reading, 5))
    finally:
        await stream.aclose()
    return outputs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("steps_per_read", [2, 3, 7])
async def test_a_stream_that_falls_behind_gets_the_missed_steps_in_one_response(case, steps_per_read):
    """Coalescing changes how tokens are grouped, never which: the same stream, fewer responses, exact indices."""
    sampling, stopping = CASES[case]
    fault_free = await _generate(_system(), _request(sampling, stopping))
    slow = await _generate_slowly(_system(), _request(sampling, stopping), steps_per_read)
    assert _token_ids(slow) == _token_ids(fault_free) and _text(slow) == _text(fault_free)
    assert _logprobs(slow) == _logprobs(fault_free)
    assert (slow[-1].finish_reason, slow[-1].stop_reason, slow[-1].usage) == (
        fault_free[-1].finish_reason,
        fault_free[-1].stop_reason,
        fault_free[-1].usage,
    )
    assert len(slow) < len(fault_free) and max(len(out.token_ids) for out in slow) > 1
    starts = [out.output_index for out in slow]
    assert starts == [sum(len(out.token_ids) for out in slow[:i]) for i in range(len(slow))]
    assert slow[0].prompt_token_ids == PROMPT and all(not out.prompt_token_ids for out in slow[1:])
    # A resume from any response boundary of the merged stream continues it exactly.
    for out in slow[1:]:
        delivered = tuple(_token_ids(fault_free)[: out.output_index])
        resumed = await _generate(_system(), _request(sampling, stopping, delivered=delivered))
        assert list(delivered) + _token_ids(resumed) == _token_ids(fault_free)


@pytest.mark.parametrize("case", CASES)
async def test_a_scheduler_behind_its_executor_sends_two_steps_per_response_never_more(case):
    """While the executor's next result is already waiting, streams are woken every other step: the first
    response still carries the first token alone, no response waits more than one step, the stream is the same."""
    sampling, stopping = CASES[case]
    fault_free = await _generate(_system(), _request(sampling, stopping))
    system = _system()
    system.handle.behind = True  # every result was here before the scheduler came for it
    behind = await _generate(system, _request(sampling, stopping))
    assert _token_ids(behind) == _token_ids(fault_free) and _text(behind) == _text(fault_free)
    assert behind[-1].usage == fault_free[-1].usage
    sizes = [len(out.token_ids) for out in behind]
    assert sizes[0] == 1 and max(sizes) == 2 and len(behind) < len(fault_free)
    assert not system.engine._held or all(not states for states in system.engine._held.values())
