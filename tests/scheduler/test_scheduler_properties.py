"""Property-based tests: random interleavings under tiny pools keep the block accounting exact.

Each example builds a tiny scheduler and a strict fake executor (see
scheduler_fakes), then runs a random program of adds, steps (with up to two
plans in flight), engine finishes, aborts, clock jumps and executor deaths.
After every operation the invariants hold; at the end everything drains within
a bounded number of steps, every block is free, the executor holds nothing,
and every output equals what the fake model generates with no memory limit.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler.scheduler_fakes import Engine, FakeExecutor, check_invariants, digest_model, reference_output

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import FinishReason
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence

EOS = 3
# Shared prefixes make prefix-cache hits (and sharing) frequent.
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [1, 2, 3, 4, 20, 21, 22])
MAX_DRAIN_STEPS = 3000


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(5, 16),
        "block_size": st.sampled_from([2, 4, 1]),
        "max_num_seqs": st.integers(2, 6),
        "max_num_batched_tokens": st.integers(3, 16),
        "max_model_len": st.integers(16, 40),
        "enable_prefix_caching": st.booleans(),
        "max_priority_wait_s": st.sampled_from([1.0, 5.0]),
    }
)

add_args = st.tuples(
    st.integers(0, len(PREFIXES) - 1),  # which prefix
    st.integers(0, 10),  # how much of it
    st.lists(st.integers(0, 49), max_size=5),  # own tail
    st.integers(1, 10),  # max_tokens
    st.integers(0, 2),  # priority
    st.sampled_from(["", "", "salt"]),
    st.booleans(),  # ignore_eos
)
# Repeats weight the choice: mostly adds and steps, now and then the rest.
OP_KINDS = ["add"] * 6 + ["step"] * 4 + ["finish", "abort", "clock", "executor_died"]
op_args = {
    "add": add_args,
    "step": st.integers(1, 6),
    "finish": st.integers(0, 30),
    "abort": st.integers(0, 30),
    "clock": st.floats(0.0, 3.0),
    "executor_died": st.none(),
}


class Harness:
    # The fake executor's model (speculation tests use one whose outputs repeat).
    model = staticmethod(digest_model)

    def __init__(self, config: dict, max_inflight: int):
        self.clock = Clock()
        self.config = SchedulerConfig(eos_token_ids=(EOS,), **config)
        self.scheduler = Scheduler(self.config, clock=self.clock)
        self.max_inflight = max_inflight
        self.engine = self._new_engine()
        self.requests: dict[int, tuple[list[int], StoppingCriteria]] = {}

    def _new_engine(self) -> Engine:
        executor = FakeExecutor(self.config.num_blocks, self.config.block_size, self.model)
        return Engine(self.scheduler, executor, self.max_inflight)

    def add(self, prefix_index, prefix_len, tail, max_tokens, priority, salt, ignore_eos):
        prompt = PREFIXES[prefix_index][:prefix_len] + tail
        if not prompt or not self.scheduler.can_fit(len(prompt), max_tokens):
            return  # the engine rejects it with INVALID_ARGUMENT
        seq_id = len(self.requests)
        stopping = StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.requests[seq_id] = (prompt, stopping)
        seq = SchedulerSequence(
            seq_id, f"r{seq_id}", prompt, SamplingParams(), stopping, priority=priority, cache_salt=salt
        )
        self.scheduler.add(seq)

    def stop(self, index: int, reason: FinishReason):
        if self.requests:
            self.engine.finish(index % len(self.requests), reason)

    def executor_died(self):
        """Results in flight are lost; every sequence restarts on a fresh executor."""
        outputs, reasons = self.engine.outputs, self.engine.finish_reasons
        seqs = self.scheduler.take_all()
        assert self.scheduler.kv.num_free_blocks == self.config.num_blocks
        self.engine = self._new_engine()
        self.engine.outputs, self.engine.finish_reasons = outputs, reasons
        for seq in seqs:
            assert seq.output_token_ids == outputs[seq.seq_id]
            self.scheduler.add(seq)

    def apply(self, kind: str, arg) -> None:
        if kind == "add":
            self.add(*arg)
        elif kind == "step":
            for _ in range(arg):
                self.engine.step()
        elif kind == "finish":
            self.stop(arg, FinishReason.STOP)
        elif kind == "abort":
            self.stop(arg, FinishReason.ABORT)
        elif kind == "clock":
            self.clock.now_s += arg
        else:
            self.executor_died()

    def check_outputs(self):
        for seq_id, (prompt, stopping) in self.requests.items():
            eos = () if stopping.ignore_eos else (EOS,)
            expected = reference_output(prompt, stopping.max_tokens, eos, self.config.max_model_len, self.model)
            got = self.engine.outputs.get(seq_id, [])
            reason = self.engine.finish_reasons[seq_id]
            ended_by_model = reason in (FinishReason.STOP, FinishReason.LENGTH) and got and got[-1] in eos + (None,)
            if ended_by_model or reason is FinishReason.LENGTH:
                assert got == expected
            else:  # stopped by the engine (stop string, abort): a prefix of the full output
                assert got == expected[: len(got)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    max_inflight=st.sampled_from([2, 1]),
    kinds=st.lists(st.sampled_from(OP_KINDS), min_size=10, max_size=50),
    data=st.data(),
)
def test_random_programs_keep_block_accounting_exact_and_drain(config, max_inflight, kinds, data):
    harness = Harness(config, max_inflight)
    for kind in kinds:
        harness.apply(kind, data.draw(op_args[kind], label=kind))
        check_invariants(harness.scheduler)
    engine, scheduler = harness.engine, harness.scheduler
    steps = 0
    while scheduler.has_unfinished() or engine.inflight:
        engine.step()
        check_invariants(scheduler)
        steps += 1
        assert steps < MAX_DRAIN_STEPS, "livelock: requests did not finish"
    engine.step()  # the last dropped ids
    pool = scheduler.kv.pool
    assert scheduler.kv.num_free_blocks == harness.config.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert engine.executor.seqs == {}
    assert set(engine.finish_reasons) == set(harness.requests)
    harness.check_outputs()


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 49), min_size=1, max_size=14), min_size=1, max_size=8),
    max_tokens=st.integers(1, 16),
    num_blocks=st.integers(8, 16),
)
def test_greedy_outputs_under_a_tiny_pool_equal_those_under_a_huge_pool(prompts, max_tokens, num_blocks):
    fitting = [p for p in prompts if len(p) + max_tokens <= 2 * num_blocks]  # what the tiny pool admits

    def run(blocks: int) -> tuple[dict[int, list[int]], int]:
        config = SchedulerConfig(num_blocks=blocks, block_size=2, max_num_batched_tokens=8, max_model_len=32)
        scheduler = Scheduler(config, clock=Clock())
        engine = Engine(scheduler, FakeExecutor(blocks, 2))
        for i, prompt in enumerate(fitting):
            scheduler.add(SchedulerSequence(i, f"r{i}", prompt, SamplingParams(), StoppingCriteria(max_tokens)))
        engine.run(max_steps=MAX_DRAIN_STEPS)
        return dict(engine.outputs), scheduler.counters.num_preemptions

    tiny, _ = run(num_blocks)
    huge, num_preemptions = run(1000)
    assert num_preemptions == 0
    assert tiny == huge and len(huge) == len(fitting)
