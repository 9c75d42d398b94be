"""The scheduler's request spans over a real scheduler core and the strict fake executor (SDK in memory)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from scheduler.scheduler_fakes import FakeExecutor

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import FinishReason
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.obs.request_trace import RequestTracer
from scheduler_svc.request import GenerationRequest, PromptInput

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _run(num_blocks: int, prompts: list[list[int]], max_tokens: int, budget: int, rope_switch_len: int = 0):
    """Every request to its end through one scheduler core; the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"))
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_model_len=64,
        rope_switch_len=rope_switch_len,
    )
    scheduler, executor = Scheduler(config, tracer=tracer), FakeExecutor(num_blocks, 4, rope_switch_len=rope_switch_len)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = SchedulerSequence(i + 1, f"r{i}", prompt, SamplingParams(), StoppingCriteria(max_tokens=max_tokens))
        tracer.start(GenerationRequest(f"r{i}", PromptInput(token_ids=tuple(prompt)), traceparent=PARENT), seq)
        scheduler.add(seq)
        seqs.append(seq)
    plans = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(plan)
        result = executor.execute(plan)
        tracer.on_step("exec-a", plan, 0.001)
        for update in scheduler.update(result):
            if update.finished:
                tracer.end(update.seq, update.seq.finish_reason)
    return exporter.get_finished_spans(), seqs, plans


def _by_request(spans, name):
    out: dict[str, list] = {}
    requests = {s.context.span_id: s.attributes["pagoda.request_id"] for s in spans if s.name == "pagoda.request"}
    for s in spans:
        if s.name == name:
            out.setdefault(requests.get(s.parent.span_id, "?"), []).append(s)
    return out


def test_one_request_has_its_queue_chunked_prefill_decode_and_finish():
    spans, (seq,), plans = _run(num_blocks=16, prompts=[list(range(10, 20))], max_tokens=5, budget=4)
    (request,) = [s for s in spans if s.name == "pagoda.request"]
    assert f"{request.context.trace_id:032x}" == PARENT.split("-")[1]
    assert f"{request.parent.span_id:016x}" == PARENT.split("-")[2]
    assert request.attributes["pagoda.finish_reason"] == "length"
    assert request.attributes["pagoda.num_completion_tokens"] == 5
    children = {s.name for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id}
    assert children == {"queue", "prefill", "decode", "finish"}
    (prefill,) = [s for s in spans if s.name == "prefill"]
    chunks = [s for s in spans if s.name == "prefill.chunk"]
    assert [c.attributes["pagoda.num_tokens"] for c in chunks] == [4, 4, 2]
    assert all(c.parent.span_id == prefill.context.span_id for c in chunks)
    # The executor is told the request span's context, once, with the admission.
    (new,) = [n for p in plans for n in p.new_seqs]
    assert new.traceparent == f"00-{request.context.trace_id:032x}-{request.context.span_id:016x}-01"


def test_a_preempted_request_has_the_event_a_second_wait_and_a_recompute():
    prompts = [list(range(10, 18)), list(range(30, 38))]
    spans, seqs, _ = _run(num_blocks=6, prompts=prompts, max_tokens=12, budget=32)
    assert sum(s.num_preemptions for s in seqs) > 0
    queues, prefills = _by_request(spans, "queue"), _by_request(spans, "prefill")
    for seq in seqs:
        request = next(
            s for s in spans if s.name == "pagoda.request" and s.attributes["pagoda.request_id"] == seq.request_id
        )
        decode = [s for s in spans if s.name == "decode" and s.parent.span_id == request.context.span_id]
        events = [e.name for span in [request, *decode] for e in span.events]
        assert events.count("preempted") == seq.num_preemptions
        reasons = [q.attributes["pagoda.queue_reason"] for q in queues[seq.request_id]]
        assert reasons == ["new"] + ["preempted"] * seq.num_preemptions
        assert len(prefills[seq.request_id]) == 1 + seq.num_preemptions


def test_a_request_outgrowing_the_short_rope_factors_has_the_event_a_wait_and_a_recompute():
    """LongRoPE switching at 12: a 10-token prompt generating 6 is recomputed on the long factors once."""
    spans, (seq,), _ = _run(num_blocks=16, prompts=[list(range(10, 20))], max_tokens=6, budget=32, rope_switch_len=12)
    (decode,) = [s for s in spans if s.name == "decode"]
    assert [e.name for e in decode.events] == ["rope_switch"]
    assert [q.attributes["pagoda.queue_reason"] for q in spans if q.name == "queue"] == ["new", "rope_switch"]
    prefills = [s for s in spans if s.name == "prefill"]
    assert [(p.attributes["pagoda.num_tokens"], p.attributes["pagoda.recompute"]) for p in prefills] == [
        (10, False),
        (13, True),
    ]


def test_a_request_span_names_its_lora_adapter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"))
    for seq_id, lora in ((1, "sql"), (2, "")):
        seq = SchedulerSequence(seq_id, f"r{seq_id}", [1, 2], SamplingParams(), StoppingCriteria(), lora_name=lora)
        tracer.start(GenerationRequest(f"r{seq_id}", PromptInput(token_ids=(1, 2)), lora=lora), seq)
        tracer.end(seq, FinishReason.STOP)
    spans = {s.attributes["pagoda.request_id"]: s for s in exporter.get_finished_spans() if s.name == "pagoda.request"}
    assert spans["r1"].attributes["pagoda.lora"] == "sql" and "pagoda.lora" not in spans["r2"].attributes
