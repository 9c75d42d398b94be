"""What tracing costs the control plane, off and on side by side in one run (docs/tracing.md).

Runs the W-mixed workload (64 requests, prompt 16..512, output 16..256, seed 0)
through one scheduler core, the engine's request tracer and the executor's
step tracer, with a result of one token per sampling sequence instead of a
model: everything tracing adds to a served step, nothing else. Each round runs
the workload with tracing off (no tracer: what the services hold when nothing
is configured) and on (the SDK, its batch processor and the OTLP/gRPC exporter
sending to a receiver in another process), in alternating order. Timed as this
thread's CPU time (the critical path: the scheduler's event loop and the
executor's servicer) and as the whole process's (the exporter's thread too).

Usage:
    .venv/bin/python bench/bench_tracing.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from executor_svc.serving.step_tracing import StepTracer
from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import SeqOutput, StepPlan, StepResult
from pagoda_bench.workload import random_workload
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.obs.request_trace import RequestTracer
from scheduler_svc.request import GenerationRequest, PromptInput

TOKEN = 7
# The receiver runs in its own process (as a collector would): its CPU is not counted.
SINK = (
    "import sys, time; sys.path.insert(0, 'bench'); import ab_serve; s = ab_serve.SpanSink(); "
    "print(s.endpoint, flush=True); time.sleep(3600)"
)


def run_workload(tracers: tuple[RequestTracer, StepTracer] | None) -> tuple[int, int]:
    """The workload to its end; (output tokens, steps)."""
    requests = random_workload(64, (16, 512), (16, 256), seed=0, vocab_size=32000)
    config = SchedulerConfig(num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_model_len=4096)
    scheduler = Scheduler(config, tracer=tracers[0] if tracers is not None else None)
    for r in requests:
        seq = SchedulerSequence(
            r.index,
            f"r{r.index}",
            list(r.prompt_token_ids),
            SamplingParams(),
            StoppingCriteria(r.output_len, ignore_eos=True),
        )
        if tracers is not None:
            tracers[0].start(GenerationRequest(f"r{r.index}", PromptInput(token_ids=r.prompt_token_ids)), seq)
        scheduler.add(seq)
    num_tokens = num_steps = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        num_steps += 1
        if tracers is not None:
            tracers[1].on_plan(plan, time.time_ns())
        result = StepResult(plan.step_id, "bench", tuple(SeqOutput(s, (TOKEN,)) for s in _sampling(scheduler, plan)))
        if tracers is not None:
            tracers[1].on_step(plan, result, time.time_ns() - 1000, time.time_ns())
            tracers[0].on_step("bench", plan, 0.001)
        for update in scheduler.update(result):
            num_tokens += len(update.new_token_ids)
            if update.finished and tracers is not None:
                tracers[0].end(update.seq, update.seq.finish_reason)
    return num_tokens, num_steps


def _sampling(scheduler: Scheduler, plan: StepPlan) -> list[int]:
    """Sequences of the plan that sample this step (their entry says so)."""
    entries = scheduler.inflight.entries(plan.step_id)
    return [seq_id for seq_id, entry in entries.items() if entry.samples]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent
    )
    try:
        endpoint = sink.stdout.readline().strip()
        from pagoda.tracing import setup_tracing, shutdown_tracing

        tracer = setup_tracing("pagoda-bench", endpoint, environ={})
        assert tracer is not None
        on = (RequestTracer(tracer), StepTracer(tracer, "bench"))
        times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for round_index in range(args.rounds):
            order = ["off", "on"] if round_index % 2 == 0 else ["on", "off"]
            for name in order:
                t0, p0 = time.thread_time(), time.process_time()
                num_tokens, num_steps = run_workload(on if name == "on" else None)
                thread_us = (time.thread_time() - t0) / num_tokens * 1e6
                process_us = (time.process_time() - p0) / num_tokens * 1e6
                times[name].append((thread_us, process_us))
                print(
                    f"round {round_index + 1} {name}: {thread_us:.2f} us thread CPU, {process_us:.2f} us process CPU"
                    f" per output token ({num_tokens} tokens, {num_steps} steps)",
                    flush=True,
                )
        shutdown_tracing()
        medians = {name: [statistics.median(v[i] for v in values) for i in (0, 1)] for name, values in times.items()}
        for name, (thread_us, process_us) in medians.items():
            print(f"{name}: median {thread_us:.2f} us thread CPU, {process_us:.2f} us process CPU per output token")
        extra = [on_us - off_us for on_us, off_us in zip(medians["on"], medians["off"])]
        print(
            f"tracing on adds {extra[0]:.2f} us (critical path), {extra[1]:.2f} us (with the exporter) per output token"
        )
    finally:
        sink.kill()
        sink.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
