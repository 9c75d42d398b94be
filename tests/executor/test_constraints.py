"""Constrained decoding in the executor: the same tokens as transformers' logits under the engine's mask.

The reference takes the unconstrained logits of the same tiny checkpoint
through transformers (the whole sequence each step), applies the mask of a
fresh llguidance matcher of the same grammar, and takes the argmax. The
executor must produce the same tokens, token for token, also after the
sequence is dropped and resent with its outputs (preemption, recompute on
another executor, a resumed stream), and next to an unconstrained sequence
in the same batch, whose tokens stay transformers' plain greedy ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from support.tiny_model import build_tiny_model, hf_greedy

from executor_svc.runner.model_runner import ModelRunner
from executor_svc.sampling.constraints import bias_of_bitmask
from executor_svc.sampling.ops import apply_bias
from pagoda import step as t
from pagoda.constraint import Constraint
from pagoda.grammar import grammar_of
from pagoda.params import SamplingParams

VOCAB_SIZE = 384
EOS_ID = 0
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["fox", "dog", "cat"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", text=json.dumps(SCHEMA)),
    "regex": Constraint("regex", text=r"[a-z]{2,5}-[0-9]{1,3}"),
    "choice": Constraint("choice", choices=("brown fox", "lazy dog", "a + b")),
    "grammar": Constraint("grammar", text='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'),
    "json_object": Constraint("json_object"),
}
PROMPT = [1, 40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("constraints") / "tiny", vocab_size=VOCAB_SIZE)


@pytest.fixture()
def runner(folder) -> ModelRunner:
    r = ModelRunner(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=2 * 1024 * 1024,
        attention_backend="torch",
        max_model_len=256,
    )
    r.enable_constraints((folder / "tokenizer.json").read_text(), (EOS_ID,))
    return r


def reference(folder: Path, prompt: list[int], constraint: Constraint, max_new: int) -> list[int]:
    """Transformers' logits, the engine's mask of a fresh matcher, argmax; stops after EOS."""
    from support.tiny_model import _load

    model = _load(folder)
    tokenizer = llguidance.LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=VOCAB_SIZE, eos_token=EOS_ID)
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(constraint), log_level=0)
    tokens, out = list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1:].float()  # [1, V]
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[None]  # [1, W]
        token = int((logits + bias_of_bitmask(mask, VOCAB_SIZE)).argmax())
        out.append(token)
        if token == EOS_ID:
            break
        assert matcher.consume_token(token)
        tokens.append(token)
    return out


class Driver:
    """Runs sequences through the runner step by step, as a scheduler would (blocks handed out in order)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 0
        self.step_id = 0
        self.blocks: dict[int, list[int]] = {}

    def _blocks_for(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        table = self.blocks.setdefault(seq_id, [])
        added = []
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.next_block)
            added.append(self.next_block)
            self.next_block += 1
        return tuple(added)

    def step(self, new=(), scheduled=()) -> t.StepResult:
        self.step_id += 1
        result = self.runner.execute(t.StepPlan(self.step_id, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled)))
        return result

    def new(self, seq_id: int, prompt: list[int], outputs: list[int], structured: Constraint | None) -> t.NewSequence:
        tokens = tuple(prompt + outputs)
        self.blocks.pop(seq_id, None)
        blocks = self._blocks_for(seq_id, len(tokens))
        return t.NewSequence(seq_id, f"r{seq_id}", tokens, len(prompt), GREEDY, blocks, 0, len(tokens), structured)

    def decode(self, seq_id: int, num_tokens: int) -> t.ScheduledSequence:
        return t.ScheduledSequence(seq_id, 1, self._blocks_for(seq_id, num_tokens + 1))


def generate(driver: Driver, seq_id: int, prompt: list[int], constraint, max_new: int, outputs=()) -> list[int]:
    """Greedy tokens of one sequence (continuing after ``outputs``), until EOS or max_new in all."""
    out = list(outputs)
    result = driver.step(new=[driver.new(seq_id, prompt, out, constraint)])
    while True:
        assert not result.errors, result.errors
        token = result.outputs[0].token_ids[0]
        out.append(token)
        if token == EOS_ID or len(out) >= max_new:
            return out
        result = driver.step(scheduled=[driver.decode(seq_id, len(prompt) + len(out))])


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_constrained_greedy_equals_the_reference(runner, folder, kind):
    constraint = CONSTRAINTS[kind]
    expected = reference(folder, PROMPT, constraint, max_new=40)
    got = generate(Driver(runner), 1, PROMPT, constraint, max_new=40)
    assert got == expected
    if expected[-1] == EOS_ID:  # a complete match: it is one, as text
        text = llguidance.LLTokenizer((folder / "tokenizer.json").read_text()).decode_str(expected[:-1])
        _assert_matches(kind, constraint, text)


def _assert_matches(kind: str, constraint: Constraint, text: str) -> None:
    if kind == "json_schema":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(constraint.text, text)
    elif kind == "choice":
        assert text in constraint.choices


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_resent_sequence_continues_from_its_tokens(runner, folder, cut):
    """Dropped and resent with its outputs (preemption, executor loss, resume): the matcher is rebuilt from them."""
    constraint = CONSTRAINTS["json_schema"]
    expected = reference(folder, PROMPT, constraint, max_new=30)
    driver = Driver(runner)
    head = generate(driver, 1, PROMPT, constraint, max_new=cut)
    # Resent whole (a known seq_id is replaced), its KV recomputed from the prompt and the outputs so far.
    assert generate(driver, 1, PROMPT, constraint, max_new=30, outputs=head) == expected


def test_unconstrained_neighbour_is_untouched(runner, folder):
    """One batch: a constrained and a plain sequence; the plain one gets transformers' greedy tokens."""
    constraint = CONSTRAINTS["regex"]
    plain_prompt = [1, 50, 51, 52]
    expected_plain = hf_greedy(folder, plain_prompt, 8)
    expected_constrained = reference(folder, PROMPT, constraint, max_new=8)
    driver = Driver(runner)
    result = driver.step(new=[driver.new(1, PROMPT, [], constraint), driver.new(2, plain_prompt, [], None)])
    outs = {1: [], 2: []}
    for _ in range(8):
        assert not result.errors
        for o in result.outputs:
            outs[o.seq_id].append(o.token_ids[0])
        live = [s for s in (1, 2) if outs[s][-1] != EOS_ID and len(outs[s]) < 8]
        if not live:
            break
        lengths = {1: len(PROMPT), 2: len(plain_prompt)}
        result = driver.step(scheduled=[driver.decode(s, lengths[s] + len(outs[s])) for s in live])
    assert outs[1] == expected_constrained[: len(outs[1])]
    assert outs[2] == expected_plain


def test_disallowed_delivered_tokens_fail_only_their_sequence(runner):
    """A resent sequence whose outputs break its constraint fails alone; its neighbour samples."""
    driver = Driver(runner)
    bad = driver.new(1, PROMPT, [45, 46], CONSTRAINTS["choice"])  # ids that spell no choice's start
    good = driver.new(2, PROMPT, [], None)
    result = driver.step(new=[bad, good])
    assert [e.seq_id for e in result.errors] == [1] and "constraint" in result.errors[0].message
    assert [o.seq_id for o in result.outputs] == [2]
    assert not runner.has_sequence(1) and runner.has_sequence(2)


def test_no_constrained_row_starts_no_mask_work(runner):
    """Unconstrained steps pay nothing: no mask job, the sampler gets no mask."""
    driver = Driver(runner)
    state_free = driver.new(1, PROMPT, [], None)
    runner._table.apply(t.StepPlan(99, new_seqs=(state_free,)))
    assert runner.constraints is not None
    assert runner.constraints.start([runner._seqs[1]]) is None


def test_runner_without_constraints_refuses_constrained_rows(folder):
    r = ModelRunner(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=1024 * 1024,
        attention_backend="torch",
        max_model_len=64,
    )
    driver = Driver(r)
    result = driver.step(new=[driver.new(1, PROMPT, [], CONSTRAINTS["regex"])])
    assert result.errors and "does not enforce constraints" in result.errors[0].message


def test_bias_of_bitmask_allows_exactly_the_set_bits():
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0], bitmask[0, 1], bitmask[0, 2] = 1 << 5, -(1 << 31), 1 << 1  # tokens 5, 63, 65
    bitmask[1] = -1  # everything
    bias = bias_of_bitmask(bitmask, 70)
    assert bias.shape == (2, 70) and bias.dtype == torch.float32
    assert torch.nonzero(bias[0] == 0).flatten().tolist() == [5, 63, 65] and torch.isinf(bias[0]).sum() == 67
    assert (bias[1] == 0).all()


@pytest.mark.parametrize("rows", [[1], [0, 1, 2], [2, 0]])
def test_apply_bias_touches_only_the_given_rows(rows):
    logits = torch.randn(3, 40)
    expected = logits.clone()
    bias = torch.zeros(len(rows), 40)
    bias[:, 7] = float("-inf")
    for r in rows:
        expected[r, 7] = float("-inf")
    assert torch.equal(apply_bias(logits, rows, bias), expected)
