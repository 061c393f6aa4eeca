"""What every config model shares: strict validation, and each numeric field's valid range shown in its
``--help`` text."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# allow_inf_nan=False: `--lr inf` or `--max-grad-norm nan` is a typo, never a setting.
# use_attribute_docstrings: each field's docstring becomes its description, the --help text cyclopts shows.
STRICT = ConfigDict(
    extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
)


def _range_text(schema: dict[str, Any]) -> str | None:
    """The valid range of one JSON-schema property (``≥ 1``, ``0 ≤ x < 1``), or None if it has none. A
    nullable field's range is its non-null branch's; a tuple's, its items' when they share one."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") != "null":
            return _range_text(branch)
    if "prefixItems" in schema:
        ranges = {_range_text(item) for item in schema["prefixItems"]}
        return f"each {ranges.pop()}" if len(ranges) == 1 and None not in ranges else None
    low = next(
        ((schema[key], op) for key, op in (("minimum", "≤"), ("exclusiveMinimum", "<")) if key in schema),
        None,
    )
    high = next(
        ((op, schema[key]) for key, op in (("maximum", "≤"), ("exclusiveMaximum", "<")) if key in schema),
        None,
    )
    if low and high:
        return f"{low[0]} {low[1]} x {high[0]} {high[1]}"
    if low:
        return f"{'≥' if low[1] == '≤' else '>'} {low[0]}"
    if high:
        return f"{high[0]} {high[1]}"
    return None


def show_ranges_in_help(model: type[BaseModel]) -> None:
    """Append each numeric field's valid range to its description (the --help text), read from the same
    constraints pydantic enforces, so that the help and the error a bad value gets cannot disagree."""
    properties = model.model_json_schema()["properties"]
    for name, field in model.model_fields.items():
        text = _range_text(properties[name])
        if text is not None:
            field.description = f"{field.description} [range: {text}]"
