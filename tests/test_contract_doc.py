"""docs/contract.md, the JSON Schema and README.md agree with skillstats/contract.py, and their links resolve."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import skillstats
from skillstats import dlq
from skillstats.contract import (
    EFFECTS,
    EPOCH_2000_MS,
    KINDS,
    MAX_ABS_DELTA,
    MAX_FUTURE_SKEW_MS,
    MAX_ID_CHARS,
    MAX_NESTING_DEPTH,
    MAX_OCCURRED_AT_MS,
    MAX_VALUE_BYTES,
    WIRE_VERSION,
    Effect,
    Reason,
)

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "contract.md"
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def schema() -> dict[str, Any]:
    """The schema as the installed package ships it."""
    return json.loads((Path(skillstats.__file__).parent / "schema" / "stat-event-v1.schema.json").read_text())


def contract_text() -> str:
    return CONTRACT.read_text(encoding="utf-8")


# --- The JSON Schema ------------------------------------------------------------------------------------------------


def test_json_schema_lists_the_same_kinds_and_bounds() -> None:
    properties = schema()["properties"]
    assert properties["kind"]["enum"] == list(KINDS)
    assert properties["v"] == {"const": WIRE_VERSION}
    for field in ("event_id", "skill_id"):
        assert properties[field]["type"] == "string"
        assert (properties[field]["minLength"], properties[field]["maxLength"]) == (1, MAX_ID_CHARS), field
    assert properties["occurred_at"]["type"] == "integer"
    assert properties["occurred_at"]["minimum"] == EPOCH_2000_MS
    assert properties["occurred_at"]["maximum"] == MAX_OCCURRED_AT_MS
    delta = properties["delta"]
    assert sorted(delta["required"]) == ["all_time", "current"]
    for field in ("all_time", "current"):
        bounds = delta["properties"][field]
        assert bounds["type"] == "integer"
        assert (bounds["minimum"], bounds["maximum"]) == (-MAX_ABS_DELTA, MAX_ABS_DELTA), field
    assert [kind for kind, effect in EFFECTS.items() if effect.uses_delta] == [
        schema()["if"]["properties"]["kind"]["const"]
    ]
    assert schema()["then"] == {"required": ["delta"]}


def test_json_schema_names_the_rules_it_cannot_express() -> None:
    description = schema()["description"]
    assert str(MAX_VALUE_BYTES) in description
    assert f"{MAX_NESTING_DEPTH} levels" in description
    assert "member twice" in description
    assert f"{MAX_FUTURE_SKEW_MS} ms" in description
    assert "docs/contract.md" in description
    assert "SPEC" not in description


# --- docs/contract.md -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_in_the_contract(kind: str) -> None:
    assert f"`{kind}`" in contract_text()


@pytest.mark.parametrize("reason", [reason.value for reason in Reason] + [dlq.REJECTED_BY_DATABASE])
def test_every_reason_code_is_in_the_contract(reason: str) -> None:
    assert f"`{reason}`" in contract_text()


def test_every_dlq_header_is_in_the_contract() -> None:
    headers = [value for name, value in vars(dlq).items() if name.startswith("H_")]
    assert len(headers) == 13
    for header in headers:
        assert f"`{header}`" in contract_text(), header


def test_the_contract_states_the_constants_of_the_code() -> None:
    text = contract_text().replace(",", "")  # 65,536 and 65536 alike
    for number in (MAX_VALUE_BYTES, MAX_NESTING_DEPTH, MAX_ID_CHARS, EPOCH_2000_MS, MAX_OCCURRED_AT_MS):
        assert str(number) in text, number
    assert f"{MAX_FUTURE_SKEW_MS} ms" in text
    assert f"|x| ≤ {MAX_ABS_DELTA}" in text
    assert "`partitioner=murmur2_random`" in text


def test_the_validity_rules_are_listed_in_check_order() -> None:
    """The numbered list under 'Validity' names each reason once, in the order from_mapping checks them."""
    section = contract_text().split("## Validity", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. `([a-z_]+)`", section, flags=re.MULTILINE)
    assert listed == [reason.value for reason in Reason]


def _amount(amount: int) -> str:
    return f"{amount:+d}" if amount else ""  # a blank cell adds nothing


def expected_row(effect: Effect) -> list[str]:
    """The cells after the kind: skill columns, then the hourly/daily columns."""
    all_time, current = (
        ("+`delta.all_time`", "+`delta.current`")
        if effect.uses_delta
        else (_amount(effect.installs_all_time), _amount(effect.installs_current))
    )
    return [
        _amount(effect.downloads),
        all_time,
        current,
        _amount(effect.window_downloads),
        _amount(effect.window_installs),
    ]


def test_the_kind_table_is_effects() -> None:
    """Each row of 'What each kind does' says what EFFECTS does, and every kind has exactly one row."""
    section = contract_text().split("## What each kind does", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    seen: list[str] = []
    for cells in rows:
        kinds = re.findall(r"`([a-z_]+)`", cells[0])
        for kind in kinds:
            assert [cell.strip() for cell in cells[1:]] == expected_row(EFFECTS[kind]), kind
        seen += kinds
    assert sorted(seen) == sorted(KINDS)


def test_the_contract_lists_every_table_and_column() -> None:
    from skillstats.sinks.schema import metadata

    section = contract_text().split("## SQL tables", 1)[1].split("\n## ", 1)[0]
    for table in metadata.sorted_tables:
        row = next((line for line in section.splitlines() if line.startswith(f"| `{table.name}` |")), None)
        assert row is not None, table.name
        for column in table.columns:
            assert re.search(rf"`{column.name}[` ]", row), f"{table.name}.{column.name}"


# --- Links ----------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def links(document: Path) -> list[str]:
    """Targets of inline and reference links, outside fenced code blocks."""
    text = FENCE.sub("", document.read_text(encoding="utf-8"))
    return [inline or reference for inline, reference in LINK.findall(text)]


def anchors(document: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    found = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", document.read_text(encoding="utf-8")), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def relative_links() -> list[tuple[Path, str]]:
    return [
        (document, target)
        for document in DOCUMENTS
        for target in links(document)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_documents_have_relative_links() -> None:
    """The checks below see something: the README links the contract, the contract the schema."""
    found = {(document.name, target) for document, target in relative_links()}
    assert ("README.md", "docs/contract.md") in found
    assert ("contract.md", "../skillstats/schema/stat-event-v1.schema.json") in found


@pytest.mark.parametrize(("document", "target"), relative_links(), ids=[f"{d.name}:{t}" for d, t in relative_links()])
def test_every_relative_link_resolves_inside_the_repository(document: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (document.parent / path).resolve() if path else document
    assert resolved.is_relative_to(ROOT), f"{document.name} links outside the repository: {target}"
    assert resolved.exists(), f"{document.name} links to a missing file: {target}"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{document.name}: no heading for #{anchor} in {resolved.name}"


def test_readme_links_nothing_outside_the_repository() -> None:
    text = README.read_text(encoding="utf-8")
    assert "../" not in text
    assert "SPEC §" not in text
    for target in links(README):
        assert not target.startswith(("/", "file:", "~")), target
