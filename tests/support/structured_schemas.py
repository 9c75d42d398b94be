"""Twenty JSON schemas for structured-output tests: nested objects, arrays, enums, number ranges, required
fields, additionalProperties false, consts, anyOf, patterns. Every string and array is bounded, so even a
random model finishes a match within a few hundred tokens."""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required or list(properties)}
    if closed:
        schema["additionalProperties"] = False
    return schema


SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": SHORT}),
    _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    _obj({"score": {"type": "integer", "minimum": -50, "maximum": 50}, "label": SHORT}),
    _obj({"tags": {"type": "array", "items": SHORT, "maxItems": 3}}),
    _obj(
        {
            "point": _obj(
                {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                }
            )
        }
    ),
    _obj(
        {"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "role": {"enum": ["admin", "guest"]}})}
    ),
    _obj(
        {
            "items": {
                "type": "array",
                "items": _obj({"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 5}}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    _obj({"kind": {"const": "event"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    _obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    _obj({"a": SHORT, "b": {"type": "integer", "minimum": 0, "maximum": 3}}, required=["a"]),
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),
    _obj({"level": {"enum": [1, 2, 3]}, "name": {"enum": ["low", "mid", "high"]}}),
    _obj({"nullable": {"anyOf": [{"type": "null"}, SHORT]}}),
    _obj(
        {
            "meta": _obj(
                {
                    "version": {"type": "integer", "minimum": 1, "maximum": 3},
                    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                }
            )
        }
    ),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    _obj({"temp": {"type": "integer", "minimum": -40, "maximum": 60}, "unit": {"enum": ["C", "F"]}, "city": SHORT}),
    _obj(
        {
            "order": _obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "lines": {
                        "type": "array",
                        "items": _obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}}),
                        "maxItems": 2,
                    },
                    "note": SHORT,
                },
                required=["id", "lines"],
            )
        }
    ),
]
