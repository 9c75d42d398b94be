"""Several tokens in one update (accepted drafts) stream exactly as the same tokens one at a time.

A stop string completed inside the run ends the request at the token that completes it:
the text, the token ids, the finish reason and the sequence's outputs (hence usage) are
those of plain decoding, which never generated the tokens after it.
"""

from __future__ import annotations

import pytest
from scheduler.test_detokenizer import train_tiny_tokenizer

from pagoda.params import SamplingParams, StoppingCriteria
from scheduler_svc.core.scheduler import SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.text.output_processor import RequestState

TOKENIZER = train_tiny_tokenizer()
SCRIPT = TOKENIZER.encode("héllo wörld 🎉 the quick brown fox, STOP here; 世界 and more", add_special_tokens=False)


def stream(stop: tuple[str, ...], group: int, include_stop: bool) -> tuple[str, list[int], object, list[int]]:
    """(text, token ids, finish reason, the sequence's outputs) with SCRIPT arriving `group` tokens at a time."""
    stopping = StoppingCriteria(max_tokens=99, stop=stop, include_stop_str_in_output=include_stop)
    seq = SchedulerSequence(1, "r1", [5, 6], SamplingParams(), stopping)
    state = RequestState(seq, TOKENIZER, True, 0)
    for i in range(0, len(SCRIPT), group):
        token_ids = tuple(SCRIPT[i : i + group])
        for token_id in token_ids:
            seq.append_token(token_id)  # as the scheduler does before the update reaches the request
        last = i + group >= len(SCRIPT)
        state.on_update(SeqUpdate(seq, token_ids, (), last))
        if state.finished:
            break
    outputs = list(iter(state.take_output, None))
    text = "".join(out.text for out in outputs)
    return text, [t for out in outputs for t in out.token_ids], outputs[-1].finish_reason, seq.output_token_ids


@pytest.mark.parametrize("stop", [("wörld 🎉 t",), ("STOP",), ("fox,", "brown"), ("界",), ("absent",)])
@pytest.mark.parametrize("include_stop", [False, True])
def test_grouped_tokens_stop_where_single_tokens_stop(stop, include_stop):
    single = stream(stop, 1, include_stop)
    for group in (2, 3, 5, len(SCRIPT)):
        assert stream(stop, group, include_stop) == single
    if stop != ("absent",):
        assert len(single[1]) < len(SCRIPT)
