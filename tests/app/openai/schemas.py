"""Five JSON schemas for structured output, each with a prompt that asks for it: objects with
required fields, enums, bounded integers, arrays, nested objects. The API tests
(tests/app/openai/test_app_structured.py) generate over them and check every reply against
its schema, as the grammar benchmark did (bench.grammar at e67cefa, retired since). Strings
are bounded so that a reply fits a small max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": (
        "Invent a person and describe them as JSON with a name, an age and an email.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "maxLength": 40},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
    ),
    "review": (
        "Classify the sentiment of this review as JSON: 'The soup was cold and the waiter rude.'",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "topic": {"enum": ["food", "service", "price", "place"]},
                "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
            },
            "required": ["sentiment", "topic", "stars"],
            "additionalProperties": False,
        },
    ),
    "date": (
        "Give a date in history and what happened, as JSON.",
        {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "event": {"type": "string", "maxLength": 40},
            },
            "required": ["year", "month", "day", "event"],
            "additionalProperties": False,
        },
    ),
    "shopping": (
        "Write a short shopping list as JSON.",
        {
            "type": "object",
            "properties": {
                "store": NAME,
                "items": {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 16},
                    "minItems": 1,
                    "maxItems": 4,
                },
                "budget": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "required": ["store", "items", "budget"],
            "additionalProperties": False,
        },
    ),
    "book": (
        "Recommend a book as JSON: its title, its author's first and last name, a rating.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 32},
                "author": {
                    "type": "object",
                    "properties": {"first": NAME, "last": NAME},
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "genres": {
                    "type": "array",
                    "items": {"enum": ["fiction", "history", "science", "poetry"]},
                    "maxItems": 2,
                },
            },
            "required": ["title", "author", "rating"],
            "additionalProperties": False,
        },
    ),
}
