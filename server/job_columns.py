"""The jobs list's picked columns on the server: sort and filter every job, not the page at hand, by
a setting ("spec:learning_rate", "spec:stall.factor") or a latest metric ("last:eval/loss").

Both live in JSON text columns (Job.spec, Job.last). A value is read twice: as a number where the JSON
holds a number, and as text, so numbers sort as numbers, strings as strings, and blanks come last
either way. SQLite reads JSON with json_type/json_extract, PostgreSQL with jsonb operators."""
from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Float, String, and_, case, cast, func, literal
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from server.models import Job
from tokenpulse.errors import SpecError

COLUMN = re.compile(r"^(last|spec):(.{1,200})$")
# "last:loss<0.5", "spec:learning_rate>=1e-4", "spec:model~gpt2" (~: the text contains it)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
FILTER = re.compile(r"^((?:last|spec):[^<>=~]{1,200}?)(>=|<=|>|<|=|~)(.{0,200})$", re.S)


@dataclass
class Value:
    number: ColumnElement  # NULL unless the JSON value is a number
    text: ColumnElement  # the value as text (a number's decimal form); NULL when absent


def printable(field: str, value: str) -> str:
    """A key or value from a URL: a NUL or another control character is a 422 naming the field (the
    database would refuse it with a 500: PostgreSQL text cannot hold a NUL)."""
    if CONTROL.search(value):
        raise SpecError(field, f"holds a control character (NUL, newline, ...): {value!r}")
    return value


def value_of(column: str, dialect: str, field: str = "sort") -> Value:
    printable(field, column)
    m = COLUMN.match(column)
    if not m:
        raise SpecError(field, f"a column is last:<metric> or spec:<setting>, not {column!r}")
    source, key = m.groups()
    # a metric name may hold dots and slashes: one key; a setting's dots walk into its sections
    doc, path = (Job.last, [key]) if source == "last" else (Job.spec, key.split("."))
    if dialect == "postgresql":
        node = cast(doc, JSONB)[tuple(path)]
        text = node.as_string()
        is_number = func.jsonb_typeof(node) == "number"
    else:
        where = "$" + "".join('."' + k.replace('"', '\\"') + '"' for k in path)
        text = cast(func.json_extract(doc, where), String)
        is_number = func.json_type(doc, where).in_(("integer", "real"))
    return Value(case((is_number, cast(text, Float)), else_=None), text)


def order_by(column: str, descending: bool, dialect: str) -> list[ColumnElement]:
    """Blanks last, then numbers, then texts, each in the asked direction; ties newest first."""
    v = value_of(column, dialect)
    blank = case((v.text.is_(None), 1), else_=0)
    number, text = (v.number.desc(), v.text.desc()) if descending else (v.number.asc(), v.text.asc())
    has_number = case((v.number.is_(None), 1), else_=0)
    return [blank, has_number, number, text, Job.id.desc()]


def filter_clause(expr: str, dialect: str) -> ColumnElement:
    """One column filter, as the jobs list's filter boxes say it: >, <, >=, <=, = compare numbers
    (a job without a number there does not pass); ~ finds a piece of the text, any case."""
    m = FILTER.match(printable("filter", expr))
    if not m:
        raise SpecError("filter", f"a filter is <column><op><value> with op one of > < >= <= = ~ "
                                  f"(\"last:loss<0.5\", \"spec:model~gpt\"), not {expr!r}")
    column, op, raw = m.groups()
    v = value_of(column, dialect, "filter")
    if op == "~":
        return func.lower(v.text).contains(raw.strip().lower(), autoescape=True)
    try:
        x = float(raw)
    except ValueError:
        raise SpecError("filter", f"{op} compares numbers; {raw!r} is not one ({expr!r})") from None
    compare = {">": v.number > x, "<": v.number < x, ">=": v.number >= x, "<=": v.number <= x,
               "=": v.number == literal(x)}[op]
    return and_(v.number.is_not(None), compare)

