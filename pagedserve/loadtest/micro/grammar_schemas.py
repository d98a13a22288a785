"""A set of typical JSON schemas (what agents and extraction apps send), each with one valid
instance, shared by the grammar-engine benchmark (loadtest/micro/bench_grammar.py) and the tests."""
from __future__ import annotations

SCHEMAS: list[tuple[str, dict, object]] = [
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }, {"name": "Ada Lovelace", "age": 36}),
    ("address", {
        "type": "object",
        "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"type": "string", "enum": ["FR", "DE", "US", "GB"]},
        },
        "required": ["street", "city", "zip", "country"],
        "additionalProperties": False,
    }, {"street": "10 Downing Street", "city": "London", "zip": "12345", "country": "GB"}),
    ("weather_tool_args", {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["location", "unit"],
        "additionalProperties": False,
    }, {"location": "Paris, France", "unit": "celsius", "days": 3}),
    ("product_list", {
        "type": "object",
        "properties": {
            "products": {
                "type": "array", "minItems": 1, "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"}, "price": {"type": "number"},
                        "in_stock": {"type": "boolean"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["sku", "price", "in_stock"],
                },
            },
        },
        "required": ["products"],
    }, {"products": [{"sku": "A-1", "price": 9.5, "in_stock": True, "tags": ["new", "sale"]},
                     {"sku": "B-22", "price": 120.0, "in_stock": False}]}),
    ("event", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "start": {"type": "string", "format": "date-time"},
            "attendees": {"type": "array", "items": {"type": "string", "format": "email"}},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
        },
        "required": ["title", "start", "priority"],
    }, {"title": "Design review", "start": "2026-11-23T10:00:00Z",
        "attendees": ["a@example.com", "b@example.org"], "priority": "high"}),
    ("sentiment", {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["label", "score"],
    }, {"label": "positive", "score": 0.93, "reasons": ["friendly tone"]}),
    ("nested_refs", {
        "$defs": {
            "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                      "required": ["x", "y"]},
        },
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}},
            "centroid": {"$ref": "#/$defs/point"},
        },
        "required": ["name", "points", "centroid"],
    }, {"name": "triangle", "points": [{"x": 0, "y": 0}, {"x": 1, "y": 0}, {"x": 0, "y": 1}],
        "centroid": {"x": 0.33, "y": 0.33}}),
    ("user_profile", {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "username": {"type": "string", "minLength": 3, "maxLength": 20},
            "email": {"type": "string"},
            "roles": {"type": "array", "items": {"type": "string", "enum": ["admin", "editor", "viewer"]}},
            "settings": {
                "type": "object",
                "properties": {"theme": {"type": "string", "enum": ["light", "dark"]},
                               "notifications": {"type": "boolean"}},
                "required": ["theme"],
            },
            "bio": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["id", "username", "roles", "settings"],
    }, {"id": 7, "username": "ada", "email": "ada@example.com", "roles": ["admin"],
        "settings": {"theme": "dark", "notifications": True}, "bio": None}),
]
