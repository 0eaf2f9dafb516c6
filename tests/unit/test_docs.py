"""The reference in docs/ checked against the code it describes, so neither drifts alone.

docs/configuration.md against the configuration classes (every key, both ways,
and its default), docs/protocol.md against ``wsd.wire.protocol`` (every operation
with its fields, every error code), docs/metrics.md against
``wsd.coordinator.metrics.FAMILIES`` (every family with its type and labels), docs/wsctl.md
against ``wsctl``'s commands and the event kinds, and every relative link in
README.md and docs/ against the files and headings it points at. No sockets,
no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from wsd.config import WsdConfig, parse_size

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# A table row whose first cell is one name in backticks: (name, the other cells).
_ROW = re.compile(r"^\| `([\w-]+)[^|]*\|(.*)\|\s*$")


def _rows(text: str) -> dict[str, list[str]]:
    return {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in map(_ROW.match, text.splitlines()) if m}


def _between(text: str, start: str, end: str | None = None) -> str:
    """The part of ``text`` from the heading ``start`` to the heading ``end`` (or the end)."""
    begin = text.index(f"\n{start}\n")
    return text[begin:text.index(f"\n{end}\n", begin)] if end else text[begin:]


# -- configuration ------------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    """{section name: its dataclass}, read from WsdConfig's fields."""
    hints = typing.get_type_hints(WsdConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(WsdConfig)
            if dataclasses.is_dataclass(hints[f.name])}


def _documented_keys() -> dict[str, dict[str, list[str]]]:
    """{section: {key: its cells}} from the tables under each ``## `[section]` `` heading."""
    text = (DOCS / "configuration.md").read_text()
    out: dict[str, dict[str, list[str]]] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        match = re.fullmatch(r"`\[(\w+)\]`", heading.strip())
        if match:
            out[match.group(1)] = _rows(body)
    return out


def test_every_configuration_key_is_documented_and_every_documented_key_exists():
    """A key added to a configuration class, or renamed, would otherwise be missing from
    docs/configuration.md, or the page would document a key the loader refuses."""
    documented = _documented_keys()
    sections = _sections()
    assert sorted(documented) == sorted(sections), "sections documented vs in WsdConfig"
    for name, cls in sections.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert not fields - set(documented[name]), f"[{name}] keys not in docs/configuration.md"
        assert not set(documented[name]) - fields, f"[{name}] keys documented that do not exist"
    # WsdConfig's other fields (where the configuration came from) are named too.
    text = (DOCS / "configuration.md").read_text()
    others = [f.name for f in dataclasses.fields(WsdConfig) if f.name not in sections]
    assert all(f"`{name}`" in text for name in others), others


def _documented_default(cell: str, field: dataclasses.Field[Any]) -> Any:
    """The value a default cell gives: ``none...``, ``true``, ``"text"``, or a number."""
    if cell.startswith("none"):
        return None
    if cell in ("true", "false"):
        return cell == "true"
    quoted = re.fullmatch(r'`"(.*)"`', cell)
    if quoted:
        return parse_size(quoted.group(1)) if field.metadata.get("size") else quoted.group(1)
    return float(cell) if "." in cell else int(cell)


def test_every_documented_default_is_the_one_in_the_code():
    """A default changed in a configuration class would leave the page telling operators
    another value than the one they get."""
    documented = _documented_keys()
    wrong = []
    for name, cls in _sections().items():
        for f in dataclasses.fields(cls):
            default = f.default.value if isinstance(f.default, enum.Enum) else f.default
            cell = documented[name][f.name][0]
            if _documented_default(cell, f) != default or (
                    isinstance(default, float) and "." not in cell):
                wrong.append(f"[{name}] {f.name}: documented {cell}, code {default!r}")
    assert not wrong, wrong


# -- protocol -----------------------------------------------------------------------------------


def test_every_operation_with_its_fields_and_every_error_code_is_in_the_protocol_doc():
    """An operation, a field or an error code added to wsd.wire.protocol would otherwise be
    undocumented, and one removed would stay on the page."""
    from wsd.wire.protocol import SCHEMAS, ErrorCode, Op

    text = (DOCS / "protocol.md").read_text()
    ops = _rows(_between(text, "## Operations", "## Error codes"))
    assert sorted(ops) == sorted(op.value for op in Op)
    missing = [f"{op}.{f.name}" for op in Op for f in SCHEMAS[op] if f"`{f.name}`" not in ops[op.value][0]]
    assert not missing, f"fields not in their operation's row: {missing}"
    codes = _rows(_between(text, "## Error codes", "## Limits"))
    assert sorted(codes) == sorted(code.value for code in ErrorCode)


def test_the_protocol_version_documented_is_the_one_spoken_and_its_release():
    """docs/protocol.md says which release's shapes the protocol version names: a bump (or a
    release) that leaves the page behind would state a policy the code does not follow."""
    from wsd.version import __version__
    from wsd.wire.protocol import PROTOCOL_VERSION

    versions = " ".join(_between((DOCS / "protocol.md").read_text(), "## Versions", "## Operations").split())
    assert f"version {PROTOCOL_VERSION} is wsd {__version__}'s" in versions


# -- metrics ------------------------------------------------------------------------------------


def test_every_metric_family_is_documented_with_its_type_and_labels():
    """A family the coordinator starts exporting (or a label it adds) would otherwise be
    missing from docs/metrics.md, and a removed one would stay there."""
    from wsd.coordinator.metrics import FAMILIES

    rows = {name: cells for name, cells in _rows(_between((DOCS / "metrics.md").read_text(), "## Families",
                                                          "## Joins with vLLM, DCGM and Kubernetes")).items()
            if name.startswith("wsd_")}
    assert sorted(rows) == sorted(FAMILIES)
    for name, (kind, labels) in FAMILIES.items():
        documented = tuple(label.strip() for label in rows[name][1].split(",") if label.strip())
        assert (rows[name][0], documented) == (kind, labels), name


def test_every_family_in_vllms_own_metrics_is_documented_with_its_labels():
    from wsd.integrations.vllm.metrics import EXPORTED, labels

    text = _between((DOCS / "metrics.md").read_text(), "## In vLLM's own /metrics", "## Scrape configuration, "
                    "alerts and dashboard")
    rows = {name: cells for name, cells in _rows(text).items() if name.startswith("wsd_")}
    assert sorted(rows) == sorted(EXPORTED)
    for name, cells in rows.items():
        assert tuple(label.strip() for label in cells[0].split(",")) == labels(name), name


def test_the_patch_points_documented_are_the_table_that_checks_and_installs_them():
    """``patches.POINTS`` drives ``check()`` and each part's install: a point added, dropped or
    changed there must be so in docs/vllm.md's table, which would otherwise list what wsd no
    longer does (or miss what it does)."""
    from wsd.integrations.vllm.patches import POINTS, RAN

    def row(point: Any) -> str:
        how = (point.how + (", where vLLM has it" if point.optional else "")
               + (", and the CPU worker's own" if point.cpu_worker else ""))
        ran = "; ".join(RAN[r] for r in point.ran)
        return f"| `{point.module}.{point.path}` | {how} | {point.why} | {ran} |"

    text = _between((DOCS / "vllm.md").read_text(), "## Patch points", "## What happens in each worker")
    documented = [line for line in text.splitlines() if line.startswith("| `")]
    assert documented == [row(point) for point in POINTS]
    seams = [line for line in text.splitlines() if line.startswith("- `")]
    assert seams == [f"- `{p.module}.{p.path}` ({p.how}): {p.seam}" for p in POINTS if p.seam]


# -- wsctl --------------------------------------------------------------------------------------


def test_every_wsctl_command_and_event_kind_is_documented():
    """A wsctl command or an event kind added to the code would otherwise be missing from
    docs/wsctl.md, and a removed one would stay there."""
    from wsd.coordinator.events import EventKind
    from wsd_client.wsctl import COMMANDS

    text = (DOCS / "wsctl.md").read_text()
    commands = _rows(_between(text, "## Commands", "## Exit codes"))
    assert sorted(commands) == sorted(COMMANDS)
    kinds = _rows(_between(text, "### Event kinds", "## Examples"))
    assert sorted(kinds) == sorted(kind.value for kind in EventKind)


def test_the_command_reply_documented_is_the_reply_type_the_coordinator_builds():
    """CommandResult is built by the coordinator and read by the client: a field added to it
    (what `wsctl --json` prints for every command) must be documented."""
    from wsd.commands import CommandResult

    text = (DOCS / "wsctl.md").read_text()
    start = text.index("- `lock`, `unlock`, `set-ubatches`")
    reply = text[start:text.index("`complete` is true", start)]
    assert [f.name for f in dataclasses.fields(CommandResult) if not re.search(rf"\b{f.name}\b", reply)] == []


def test_a_ranks_row_documented_is_the_row_declared():
    """``wsd.rankrow.RankRow`` drives the coordinator's ``ranks`` rows and the client's
    ``RankEntry``: a field added, renamed or retyped there must be so in docs/wsctl.md's table."""
    from wsd.rankrow import row_fields

    def shown(kind: Any) -> str:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return f"`{args[0].__name__}` or null" if args else f"`{kind.__name__}`"

    text = (DOCS / "wsctl.md").read_text()
    table = _rows(_between(text, "### A rank's row", "### Event kinds"))
    documented = {name: cells[0] for name, cells in table.items()}
    assert documented == {name: shown(kind) for name, kind, _ in row_fields()}


# -- links --------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PAGES = sorted([ROOT / "README.md", *DOCS.glob("*.md")])


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    """A page renamed or moved, or a heading reworded, would leave links pointing at nothing."""
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this checkout's
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_stays_a_front_door_that_links_every_doc():
    """The README is what it is, the quick start, a walk-through and links; the reference
    lives in docs/, and a page nobody links to is a page nobody finds."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = {Path(t.partition("#")[0]).name for t in _LINK.findall(readme) if t.startswith("docs/")}
    assert not {p.name for p in DOCS.glob("*.md")} - linked


def test_tests_and_benchmarks_say_what_they_check_not_which_issue_asked():
    """An issue or promise number means nothing to whoever carries the code on: nowhere in the
    repository says what a numbered issue was. Each test says the requirement itself."""
    cited = re.compile(r"\b(?:[Ii]ssue|[Pp]romise)s? \d+")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if cited.search(line)]
    assert found == []
