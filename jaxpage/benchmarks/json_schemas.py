"""JSON-schema tasks for structured outputs: a chat prompt and the schema its answer must follow, 24 of them, from
flat records to nested objects, arrays, enums, required and optional fields, bounded numbers and strings with
patterns. scripts/bench_structured.py runs them; tests/test_structured_outputs.py checks that every answer the
default model gives under them parses and validates."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchemaTask:
    name: str
    prompt: str
    schema: dict


def _string(max_length: int = 40, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    schema["required"] = list(properties) if required is None else required
    return schema


SCHEMA_TASKS = [
    SchemaTask(
        "person",
        "Describe a person named Alice who is 30.",
        _object({"name": _string(), "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    ),
    SchemaTask("boolean-flag", "Is the sky blue? Answer as JSON.", _object({"answer": {"type": "boolean"}})),
    SchemaTask("color-enum", "What color is grass?", _object({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    SchemaTask(
        "sentiment",
        "Classify the sentiment of: 'I love this phone.'",
        _object(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    SchemaTask(
        "city",
        "Give the capital of France and its population.",
        _object({"city": _string(), "country": _string(), "population": {"type": "integer", "minimum": 0}}),
    ),
    SchemaTask(
        "book",
        "Describe a famous book.",
        _object(
            {
                "title": _string(60),
                "author": _string(),
                "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
                "genres": {"type": "array", "items": _string(20), "minItems": 1, "maxItems": 3},
            }
        ),
    ),
    SchemaTask("point", "Give a point in 2D space.", _object({"x": {"type": "number"}, "y": {"type": "number"}})),
    SchemaTask(
        "date",
        "When did the first moon landing happen?",
        _object({"event": _string(), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    ),
    SchemaTask(
        "email",
        "Invent a contact for a support desk.",
        _object({"name": _string(), "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}}),
    ),
    SchemaTask(
        "phone",
        "Give a US phone number for a pizza place.",
        _object({"business": _string(), "phone": {"type": "string", "pattern": "^\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}$"}}),
    ),
    SchemaTask(
        "shopping-list",
        "Make a shopping list for pancakes.",
        _object(
            {
                "items": {
                    "type": "array",
                    "items": _object(
                        {"name": _string(20), "quantity": {"type": "integer", "minimum": 1, "maximum": 12}}
                    ),
                    "minItems": 1,
                    "maxItems": 4,
                }
            }
        ),
    ),
    SchemaTask(
        "address",
        "Give the address of a museum.",
        _object(
            {
                "museum": _string(),
                "address": _object(
                    {"street": _string(), "city": _string(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                ),
            }
        ),
    ),
    SchemaTask(
        "optional-fields",
        "Describe a cat; a nickname is optional.",
        _object(
            {"name": _string(20), "nickname": _string(20), "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
            required=["name", "lives"],
        ),
    ),
    SchemaTask(
        "weather",
        "Report the weather in Oslo.",
        _object(
            {
                "city": _string(20),
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            }
        ),
    ),
    SchemaTask(
        "recipe",
        "Give a short recipe for tea.",
        _object(
            {
                "name": _string(),
                "steps": {"type": "array", "items": _string(60), "minItems": 1, "maxItems": 4},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
            }
        ),
    ),
    SchemaTask(
        "movie-rating",
        "Rate the movie Inception.",
        _object(
            {
                "title": _string(),
                "rating": {"type": "integer", "minimum": 1, "maximum": 10},
                "recommended": {"type": "boolean"},
            }
        ),
    ),
    SchemaTask(
        "tags",
        "List three tags for a blog post about hiking.",
        _object(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z]{1,15}$"},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),
    SchemaTask(
        "employee",
        "Describe an employee of a small company.",
        _object(
            {
                "name": _string(),
                "role": {"enum": ["engineer", "manager", "designer", "sales"]},
                "manager": {"anyOf": [_string(), {"type": "null"}]},
                "salary": {"type": "integer", "minimum": 0, "maximum": 1000000},
            }
        ),
    ),
    SchemaTask(
        "nested-tree",
        "Describe a folder with two files.",
        _object(
            {
                "folder": _string(20),
                "files": {
                    "type": "array",
                    "items": _object(
                        {"name": _string(20), "size_kb": {"type": "integer", "minimum": 0, "maximum": 100000}}
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
                "owner": _object({"user": _string(20), "admin": {"type": "boolean"}}),
            }
        ),
    ),
    SchemaTask(
        "math",
        "What is 12 times 12? Show the operation.",
        _object(
            {
                "a": {"type": "integer"},
                "b": {"type": "integer"},
                "operation": {"enum": ["+", "-", "*", "/"]},
                "result": {"type": "integer"},
            }
        ),
    ),
    SchemaTask(
        "language",
        "Name a programming language and its creator.",
        _object({"language": _string(20), "creator": _string(), "typed": {"enum": ["static", "dynamic"]}}),
    ),
    SchemaTask(
        "hex-color",
        "Give the hex code of pure red.",
        _object({"name": _string(20), "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    ),
    SchemaTask(
        "inventory",
        "Describe a product in stock.",
        _object(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
                "variants": {"type": "array", "items": {"enum": ["small", "medium", "large"]}, "maxItems": 3},
            }
        ),
    ),
    SchemaTask(
        "event",
        "Plan a team meeting.",
        _object(
            {
                "title": _string(),
                "attendees": {"type": "array", "items": _string(20), "minItems": 1, "maxItems": 4},
                "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 240},
                "remote": {"type": "boolean"},
            }
        ),
    ),
]
