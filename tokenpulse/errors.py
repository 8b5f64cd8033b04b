"""SpecError: a job spec the user can fix (a missing file, an unknown column, an unreadable model).

One class for every side: the server's submit checks (server/validate.py, a 422 naming the field),
the training process and the analyzer (worker/training/, exit code EXIT_SPEC, never retried).
Stdlib only: the lowest layer, importable from anywhere (tests/test_boundaries.py)."""
from __future__ import annotations

from typing import Optional


class SpecError(ValueError):
    """field: the spec field to fix (dotted for nested ones: "lora.load_in_4bit"); errors: every
    field's problem when a check found more than one ({"field", "message"} each)."""

    def __init__(self, field: str, message: str, errors: Optional[list[dict]] = None):
        super().__init__(message)
        self.field = field
        self.message = message
        self.errors = errors or [{"field": field, "message": message}]

    def as_json(self) -> dict:
        return {"error": self.message, "field": self.field}
