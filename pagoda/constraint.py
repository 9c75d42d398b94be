"""The output constraint of a request (structured outputs), as plain data.

One definition for every layer: the client builds it, the scheduler validates
it (``pagoda.grammar``), the step protocol carries it to the executor, whose
matcher enforces it. The proto message is ``pagoda.v1.StructuredOutput``
(``pagoda.constraint_pb`` converts). Pure Python: no torch, numpy or protobuf.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")
# Bounds on what a client may send (a schema, regex or grammar is compiled per request).
MAX_TEXT_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output must match: one kind and its value."""

    kind: ConstraintKind
    # The JSON schema, regex or Lark grammar text ("" for json_object and choice).
    text: str = ""
    # The strings of a choice.
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field it came from, for error messages (``structured.json_schema``)."""
        return f"structured.{self.kind}"

    def problem(self) -> str | None:
        """Why the value is malformed whatever the engine says (empty, too large), or None."""
        if self.kind == "choice":
            if not self.choices:
                return "needs at least one string"
            if len(self.choices) > MAX_CHOICES:
                return f"at most {MAX_CHOICES} strings, got {len(self.choices)}"
            if not all(self.choices) or sum(len(c) for c in self.choices) > MAX_TEXT_CHARS:
                return f"strings must be non-empty, {MAX_TEXT_CHARS} characters in all at most"
            return None
        if self.kind == "json_object":
            return None
        if not self.text:
            return "must not be empty"
        if len(self.text) > MAX_TEXT_CHARS:
            return f"at most {MAX_TEXT_CHARS} characters, got {len(self.text)}"
        return None
