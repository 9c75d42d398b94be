"""The generation parameters shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.v1 import generation_pb2
from pagoda_client._wire import SAMPLING_FIELDS, build_generate_request


def request_from_args(args: Mapping[str, Any]) -> generation_pb2.GenerateRequest:
    """Build a ``GenerateRequest`` from a generate/stream call's arguments."""
    return build_generate_request(
        args["prompt"],
        args["token_ids"],
        args["messages"],
        sampling={name: args[name] for name in SAMPLING_FIELDS},
        max_tokens=args["max_tokens"],
        stop=args["stop"],
        stop_token_ids=args["stop_token_ids"],
        ignore_eos=args["ignore_eos"],
        include_stop_str_in_output=args["include_stop_str_in_output"],
        priority=args["priority"],
        cache_salt=args["cache_salt"],
        request_id=args["request_id"],
        skip_special_tokens=args["skip_special_tokens"],
        add_generation_prompt=args.get("add_generation_prompt"),
    )
