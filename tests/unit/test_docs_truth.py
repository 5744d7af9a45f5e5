"""README.md and docs/ say only what the code does: every name they use exists in the code.

The docs are PARSED (tables under their headers, backticked spans, code blocks, calls such as
``GuardConfig(...)``) and what they name is looked up in the code's own enumerations:
``dataclasses.fields(GuardConfig)``, the :mod:`ampguard.vocab` enums, ``ampguard.__all__``,
:data:`ampguard.metrics.CATALOGUE`, the alerts and recording rules :mod:`ampguard.dashboards`
builds, the argparse parsers of the ``ampguard`` command, :data:`ampguard.stats.LOCAL_K`. No name
is listed here by hand: a new field, reason, error, metric or flag is checked the day it exists.

Where the docs enumerate something on purpose (the configuration table, the ``reason``/``kind``/
``phase``/``cause`` lists, the Errors table, the command table), the enumeration must also be
complete. Each failure names the file and line, the name, and what the code has.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ampguard
from ampguard import cli, dashboards, metrics, stats, vocab
from ampguard.config import Escalation, GuardConfig
from ampguard.records import Anomaly, RunInfo, StepReport

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README = ROOT / "README.md"

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[^\n`]*)\n"
                   r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)
TICKED = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")  # inline code, which may wrap a line
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------------------------- the parser
@dataclasses.dataclass(frozen=True)
class Span:
    """A piece of a doc: its text, where it starts, and what it is."""

    path: Path
    line: int
    text: str
    kind: str  # "code" (a fenced block), "ticked" (inline code), "prose" (the rest)
    lang: str = ""

    def where(self, offset: int = 0) -> str:
        return f"{_rel(self.path)}:{self.line + self.text.count(chr(10), 0, offset)}"


@dataclasses.dataclass(frozen=True)
class Table:
    path: Path
    line: int
    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, *names: str) -> int | None:
        """The index of the first header cell that is (or whose backticked text is) one of ``names``."""
        for i, cell in enumerate(self.header):
            words = {cell.strip().lower(), *(t.lower() for t in ticked(cell))}
            if words & set(names):
                return i
        return None

    def where(self, row: int) -> str:
        return f"{_rel(self.path)}:{self.line + 2 + row}"


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def ticked(text: str) -> list[str]:
    return [m.group(1) for m in TICKED.finditer(text)]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def spans(path: Path) -> Iterator[Span]:
    """The fenced code blocks of a doc, its inline code spans and its prose, with line numbers."""
    text = path.read_text(encoding="utf-8")
    pos = 0
    for m in FENCE.finditer(text):
        yield from _prose_spans(path, text, pos, m.start())
        yield Span(path, _line_of(text, m.start("body")), m.group("body"), "code", m.group("lang").strip())
        pos = m.end()
    yield from _prose_spans(path, text, pos, len(text))


def _prose_spans(path: Path, text: str, start: int, end: int) -> Iterator[Span]:
    chunk = text[start:end]
    yield Span(path, _line_of(text, start), TICKED.sub(" ", chunk), "prose")
    for m in TICKED.finditer(chunk):
        yield Span(path, _line_of(text, start + m.start()), m.group(1), "ticked")


def all_spans(kinds: tuple[str, ...] = ("code", "ticked", "prose")) -> Iterator[Span]:
    for path in DOCS:
        yield from (s for s in spans(path) if s.kind in kinds)


def _cells(line: str) -> tuple[str, ...]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    cells, cell, in_tick = [], "", False
    for i, ch in enumerate(body):
        if ch == "`":
            in_tick = not in_tick
        if ch == "|" and not in_tick and (i == 0 or body[i - 1] != "\\"):
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    cells.append(cell.strip())
    return tuple(cells)


def tables(path: Path) -> Iterator[Table]:
    """The markdown tables of a doc outside code blocks, each with the heading it sits under."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    lines = text.split("\n")
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        delimiter = i + 1 < len(lines) and re.fullmatch(r"\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*",
                                                         lines[i + 1])
        if line.lstrip().startswith("|") and delimiter:
            start, rows = i, []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield Table(path, start + 1, heading, _cells(line), tuple(rows))
            continue
        i += 1


def all_tables() -> Iterator[Table]:
    for path in DOCS:
        yield from tables(path)


def section(path: Path, heading: str) -> str:
    """The text of a doc under the heading ``heading`` (to the next heading of its level or above)."""
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    assert m, f"{path.name} has no heading {heading!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.MULTILINE)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def calls(text: str, name: str) -> Iterator[tuple[int, str]]:
    """``(offset, arguments)`` of every call ``name(...)`` in ``text`` (balanced parentheses)."""
    for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield m.start(), text[m.end(): i - 1]


def top_level(arguments: str, pattern: str) -> list[str]:
    """Matches of ``pattern`` (one group) at nesting depth 0 of an argument list or a dict body."""
    flat, depth = [], 0
    for ch in arguments:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        flat.append(ch if depth == 0 or ch in "([{" else " ")
    return re.findall(pattern, "".join(flat))


# ---------------------------------------------------------------------------------- the code's names
FIELDS = {cls: {f.name: f for f in dataclasses.fields(cls)} for cls in (GuardConfig, Escalation)}
VOCAB = {"reason": vocab.SkipReason, "kind": vocab.AnomalyKind, "phase": vocab.Phase, "cause": vocab.Cause}
REPORT_FIELDS = {f.name for cls in (StepReport, Anomaly, RunInfo) for f in dataclasses.fields(cls)}
EXPORTED = set(ampguard.__all__)
ERRORS = {n for n in EXPORTED if isinstance(getattr(ampguard, n), type) and issubclass(getattr(ampguard, n),
                                                                                     BaseException)}
BUILTIN_ERRORS = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)}
RULES = dashboards.build_rules()
RECORDED = {r["record"] for g in RULES["groups"] for r in g["rules"] if "record" in r}
METRIC = re.compile(r"(?<![\w:/.\-])(ampguard_[a-z0-9_]+)(?![\w:])")
RECORDING = re.compile(r"(?<![\w])([a-z_]+:ampguard_[a-z0-9_]+:[a-z0-9_]+)")
ALERT = re.compile(r"\b(Ampguard[A-Z][A-Za-z0-9]+)\b")


def _help(command: str) -> str:
    """``ampguard COMMAND --help``, as the command prints it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


FLAGS = {command: _flags(_help(command)) - {"--help"} for command in cli._COMMANDS}


# ---------------------------------------------------------------------------------- the checks
def test_the_parser_reads_what_it_checks():
    # Not vacuous: each check below has material to read in today's docs.
    assert any(t.column("field") == 0 for t in all_tables())
    assert any(t.column("error") == 0 for t in all_tables())
    assert any(t.column("command") == 0 for t in all_tables())
    assert any(calls(s.text, "GuardConfig") for s in all_spans(("code", "ticked")))
    assert any(METRIC.search(s.text) for s in all_spans(("ticked",)))
    assert len(list(all_spans(("code",)))) > 20


def test_config_fields_named_in_the_docs_are_guard_config_fields():
    bad = []
    for s in all_spans(("code", "ticked")):
        for cls in (GuardConfig, Escalation):
            known = FIELDS[cls]
            for offset, args in calls(s.text, cls.__name__):
                keywords = top_level(args, r"\b([a-z_]\w*)\s*=(?!=)")
                bad += [(s.where(offset), f"{cls.__name__}({k}=...)") for k in keywords if k not in known]
            for m in re.finditer(rf"(?<![\w.]){cls.__name__}\.([a-z_]\w*)", s.text):
                if m.group(1) not in known and not hasattr(cls, m.group(1)):
                    bad.append((s.where(m.start()), f"{cls.__name__}.{m.group(1)}"))
        for m in re.finditer(r"\b(?:guard_)?config\s*=\s*\{", s.text):  # wrap(config={...}) and friends
            depth, i = 1, m.end()
            while i < len(s.text) and depth:
                depth += {"{": 1, "}": -1}.get(s.text[i], 0)
                i += 1
            bad += [(s.where(m.start()), f"config key {k!r}") for k in top_level(s.text[m.end(): i - 1],
                                                                                r"[\"'](\w+)[\"']\s*:")
                    if k not in FIELDS[GuardConfig]]
    assert not bad, f"names that are no GuardConfig/Escalation field: {bad}"


def _default(cell: str) -> object:
    text = cell.strip().strip("`").replace("_", "")
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if re.fullmatch(r"(Spikes|ZClip|Escalation)\(\)", text):  # a config part with its own defaults
        return getattr(ampguard, text[:-2])()
    if re.fullmatch(r"[\"'].*[\"']", text):
        return text[1:-1]
    return float(text) if re.fullmatch(r"[-+0-9.e]+", text) else cell


def test_the_configuration_table_has_every_field_with_its_default():
    # a configuration table: first column "field", most of whose names are GuardConfig's (a table of
    # the JSONL record's fields, say, is about something else)
    def is_config(t: Table) -> bool:
        names = [n for row in t.rows for n in ticked(row[0])[:1]]
        return t.column("field") == 0 and 2 * sum(n in FIELDS[GuardConfig] for n in names) > len(names)

    found = [t for t in all_tables() if is_config(t)]
    assert found, "no configuration table (a table whose first column is 'field', of GuardConfig fields)"
    bad, mentioned = [], set()
    for t in found:
        default = t.column("default")
        for i, row in enumerate(t.rows):
            names = ticked(row[0])
            if len(names) != 1 or names[0] not in FIELDS[GuardConfig]:
                bad.append((t.where(i), f"{row[0]} is no GuardConfig field"))
                continue
            field = FIELDS[GuardConfig][names[0]]
            mentioned.update(ticked(" ".join(row)))
            if default is not None and _default(row[default]) != field.default:
                bad.append((t.where(i), f"{field.name}: default {row[default]} in the table, {field.default!r} in "
                            "the code"))
    missing = sorted(set(FIELDS[GuardConfig]) - mentioned)
    assert not bad and not missing, (f"configuration table: {bad}; GuardConfig fields the table does not name "
                                     f"(add a row): {missing}")


def _enumerations(label: str) -> Iterator[tuple[str, list[str]]]:
    """Lists of words the docs give for a record field, written ``label`` (`a` | `b` ...) or
    ``label`` (`a`, `b`, ...): the backticked words inside the parentheses after it."""
    for path in DOCS:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
        for m in re.finditer(rf"`{label}`\s*\(", text):
            depth, i = 1, m.end()
            while i < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            words = [w for w in ticked(text[m.end(): i - 1]) if IDENT.match(w)]
            if len(words) >= 2:  # a list; one about the vocabulary when most of its words are (see below)
                yield f"{_rel(path)}:{_line_of(text, m.start())}", words


@pytest.mark.parametrize("label", sorted(VOCAB))
def test_lists_of_reasons_kinds_phases_and_causes_are_the_vocabulary(label):
    values = {str(v) for v in VOCAB[label]}
    found, bad = 0, []
    for where, words in _enumerations(label):
        if 2 * len(set(words) & values) < len(set(words)):
            continue  # a list of something else that has a field of the same name (an OpenTelemetry `kind`, ...)
        found += 1
        unknown = sorted(set(words) - values)
        missing = sorted(values - set(words))
        if unknown or missing:
            bad.append((where, {"not in the code": unknown, "missing": missing}))
    assert not bad, f"the docs' lists of `{label}` differ from {VOCAB[label].__name__}: {bad}"
    if label in ("reason", "kind"):
        assert found, f"no list of `{label}` values found in the docs"


def _leading_word(cell: str) -> str:
    m = re.match(r"`([A-Za-z_]\w*)`", cell.strip())
    if m:
        return m.group(1)
    return cell.strip() if IDENT.match(cell.strip()) and cell.strip() not in ("None", "-") else ""


def test_label_values_and_table_cells_are_the_vocabulary():
    allowed = {
        "reason": {str(v) for v in vocab.SkipReason},
        "kind": {str(v) for v in vocab.AnomalyKind} | set(metrics.NONFINITE_KINDS),
        "phase": {str(v) for v in vocab.Phase},
        "cause": {str(v) for v in vocab.Cause},
    }
    bad = []
    for s in all_spans(("code", "ticked")):
        # PromQL label matchers ({reason="nonfinite_loss"}) and records (Anomaly(kind="overflow")); a
        # keyword of the same name elsewhere (an OpenTelemetry instrument's kind=...) is another word
        labelled = r"(?:\{[^{}\n]*?|(?:Anomaly|StepReport)\([^()\n]*?)"
        for m in re.finditer(labelled + r"\b(reason|kind|phase|cause)\s*=\s*[\"']([^\"']*)[\"']", s.text):
            if m.group(2) not in allowed[m.group(1)] and not m.group(2).startswith("$"):
                bad.append((s.where(m.start()), f'{m.group(1)}="{m.group(2)}"'))
    for t in all_tables():
        for label, values in allowed.items():
            col = t.column(label)
            if col is None:
                continue
            # the leading word of each cell (`word`..., or a cell that is one word); the column is about
            # the vocabulary when one of them is in it (a `kind` column of counter/gauge is not)
            leading = [(i, _leading_word(row[col] if col < len(row) else "")) for i, row in enumerate(t.rows)]
            if any(w in values for _, w in leading):
                bad += [(t.where(i), f"{label} {w!r}") for i, w in leading if w and w not in values]
    assert not bad, f"values that are in no ampguard.vocab enum: {bad}"


def test_record_fields_named_in_the_docs_exist():
    bad = []
    for s in all_spans(("code", "ticked", "prose")):
        for m in re.finditer(r"(?<![\w.])(StepReport|Anomaly|RunInfo)\.([a-z_]\w*)", s.text):
            if m.group(2) not in REPORT_FIELDS and not hasattr(getattr(ampguard, m.group(1)), m.group(2)):
                bad.append((s.where(m.start()), f"{m.group(1)}.{m.group(2)}"))
    for t in all_tables():
        col = t.column("stepreport", "stepreport field")
        if col is None:
            continue
        for i, row in enumerate(t.rows):
            bad += [(t.where(i), f"StepReport field {w!r}") for w in ticked(row[col])
                    if IDENT.match(w) and w not in REPORT_FIELDS]
    assert not bad, f"record fields that StepReport/Anomaly/RunInfo do not have: {bad}"


def test_error_names_are_importable_from_ampguard_and_the_errors_table_is_complete():
    bad = []
    for s in all_spans(("code", "ticked", "prose")):
        for m in re.finditer(r"(?<![\w])((?:[A-Za-z_]\w*\.)*)([A-Z]\w*Error)\b", s.text):
            qualifier, name = m.group(1), m.group(2)
            if qualifier and qualifier != "ampguard.":
                continue  # another library's error (torch.cuda.OutOfMemoryError), or a submodule's own path
            if name not in ERRORS and name not in BUILTIN_ERRORS:
                bad.append((s.where(m.start()), name))
    assert not bad, f"error classes the docs name that `from ampguard import ...` cannot import: {bad}"
    errors = section(README, "Errors")
    table = [t for t in tables(README) if t.column("error") == 0]
    assert table, "README has no Errors table"
    missing = sorted(n for n in ERRORS if f"`{n}`" not in errors and f"`ampguard.{n}`" not in errors)
    assert not missing, f"errors ampguard exports that README's Errors section does not name: {missing}"


def test_metric_alert_and_recording_rule_names_are_the_catalogues():
    bad = []
    for s in all_spans(("code", "ticked", "prose")):
        for m in METRIC.finditer(s.text):
            try:
                metrics.by_name(m.group(1))
            except KeyError:
                bad.append((s.where(m.start()), m.group(1)))
        bad += [(s.where(m.start()), m.group(1)) for m in RECORDING.finditer(s.text) if m.group(1) not in RECORDED]
        bad += [(s.where(m.start()), m.group(1)) for m in ALERT.finditer(s.text) if m.group(1) not in dashboards.ALERTS]
    assert not bad, f"metric, recording-rule or alert names that ampguard does not produce: {bad}"


def _top_level_names(module: str) -> set[str] | None:
    """The names a module defines or imports at its top level, read from its source (not imported:
    an integration's module imports its framework, which is slow or absent); None if no such module."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    names: set[str] = set()
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_attributes_of_the_guarded_optimizer_the_docs_use_exist():
    # `opt.x` / `guard.x` (the guarded optimizer, as the docs name it) and `opt.history.x`, looked up
    # with dir() on a real one: instance attributes count, and no property is evaluated.
    model = torch.nn.Linear(2, 2)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    try:
        owners = {"": set(dir(opt)), "history.": set(dir(opt.history))}
    finally:
        opt.close()
    bad = []
    for s in all_spans(("code", "ticked")):
        for m in re.finditer(r"(?<![\w.])(?:opt|guard)\.(history\.)?([A-Za-z_]\w*)(?![\w.]*\.(?:py|md)\b)", s.text):
            if m.group(2) != "py" and m.group(2) not in owners[m.group(1) or ""]:
                bad.append((s.where(m.start()), m.group(0)))
    assert not bad, f"attributes the guarded optimizer (or its history) does not have: {bad}"


def _in_source(module: str, rest: list[str]) -> bool:
    """Is ``rest`` (submodules, then a name) found from ``module`` on, reading sources only?"""
    for part in rest:
        sub = f"{module}.{part}"
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations and importlib.util.find_spec(sub) is not None:
            module = sub
            continue
        names = _top_level_names(module)
        return names is not None and part in names  # attributes past a top-level name are not followed
    return True


def _resolves(dotted: str) -> bool:
    """Does ``ampguard.x.y.Z`` exist? What is imported is looked up; a submodule not imported yet is
    found by its spec, and the name after it in its source."""
    parts = dotted.split(".")
    obj: object = ampguard
    for i, part in enumerate(parts[1:], 1):
        name = ".".join(parts[: i + 1])
        if name in sys.modules:
            obj = sys.modules[name]
            continue
        if hasattr(obj, "__path__") and importlib.util.find_spec(name) is not None:  # a submodule, not imported
            return _in_source(name, parts[i + 1:])
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
        except ImportError:
            return True  # a lazy export whose optional dependency is not installed here: it exists
    return True


def test_ampguard_names_the_docs_call_or_import_exist():
    bad = []
    for s in all_spans(("code", "ticked")):
        # classes (ampguard.GuardConfig) and calls (ampguard.wrap(...)); lower-case names that are not
        # called may be files (ampguard.json) or other conventions (metric names), and are left alone
        for m in re.finditer(r"(?<![\w.])(ampguard(?:\.[A-Za-z_]\w*)+)(\()?", s.text):
            dotted, called = m.group(1), m.group(2)
            if (called or dotted.split(".")[-1][:1].isupper()) and not _resolves(dotted):
                bad.append((s.where(m.start()), dotted))
        for m in re.finditer(r"^\s*from (ampguard(?:\.\w+)*) import \(?([\w, ]+)", s.text, re.MULTILINE):
            names = [item.split()[0] for item in m.group(2).split(",") if item.strip()]  # `x as y`: x is imported
            bad += [(s.where(m.start()), f"{m.group(1)}.{n}") for n in names if not _resolves(f"{m.group(1)}.{n}")]
    assert not bad, f"names under ampguard that do not exist: {bad}"


def test_command_lines_use_real_flags_and_the_command_table_has_every_flag():
    bad = []
    for s in all_spans(("code", "ticked")):
        for m in re.finditer(r"(?<![\w/.-])ampguard (demo|report|dashboards|preflight)\b([^\n`]*(?:\n(?!\s*\n)"
                             r"[^\n`]*)*)" if s.kind == "ticked" else
                             r"(?<![\w/.-])ampguard (demo|report|dashboards|preflight)\b([^\n]*)", s.text):
            bad += [(s.where(m.start()), f"ampguard {m.group(1)} {f}") for f in sorted(_flags(m.group(2)))
                    if f not in FLAGS[m.group(1)]]
    table = [t for t in all_tables() if t.column("command") == 0]
    assert table, "no command table (a table whose first column is 'command')"
    listed: dict[str, set[str]] = {}
    for t in table:
        for row in t.rows:
            m = re.match(r"`ampguard (\w+)", row[0])
            if m:
                listed.setdefault(m.group(1), set()).update(_flags(row[0]))
    missing = {c: sorted(FLAGS[c] - listed.get(c, set())) for c in FLAGS if FLAGS[c] - listed.get(c, set())}
    assert not bad and not missing, (f"flags the commands do not have: {bad}; flags the command table leaves out: "
                                     f"{missing}")


def test_the_gathered_vector_is_as_wide_as_the_code_packs():
    bad = []
    for s in all_spans(("code", "ticked", "prose")):
        for m in re.finditer(r"\[world(?:_size)?,\s*(\d+)\]", s.text):
            if int(m.group(1)) != stats.LOCAL_K:
                bad.append((s.where(m.start()), m.group(0)))
        for m in re.finditer(r"\b(\d+) floats\b", s.text):
            line = s.text[s.text.rfind("\n", 0, m.start()) + 1: s.text.find("\n", m.end()) % (len(s.text) + 1)]
            if re.search(r"gather|vector|pack", line) and int(m.group(1)) != stats.LOCAL_K:
                bad.append((s.where(m.start()), m.group(0)))
    assert not bad, f"widths that are not stats.LOCAL_K ({stats.LOCAL_K}) floats: {bad}"


def test_fault_values_in_examples_fit_fp16():
    # Faults in the docs' code examples run under fp16 autocast: a finite value must fit float16
    # (faults.* raise ValueError naming the dtype otherwise; prose may say so with an inline example).
    largest = torch.finfo(torch.float16).max
    bad = []
    for s in all_spans(("code",)):
        for kind in ("output", "grad", "backward", "loss"):
            for offset, args in calls(s.text, f"faults.{kind}"):
                for value in top_level(args, r"(?:^|,)\s*([-+]?\d[\d_.]*(?:e[-+]?\d+)?)\s*(?=,|$)"):
                    if abs(float(value.replace("_", ""))) > largest:
                        bad.append((s.where(offset), f"faults.{kind}(..., {value}, ...)"))
    assert not bad, f"fault values beyond float16's largest finite value {largest:g}: {bad}"


def test_hand_written_guarded_loops_step_the_lr_through_the_guard():
    # A plain sched.step() after opt.step() also advances on skipped steps: a loop that calls
    # opt.backward/opt.step itself hands its scheduler to opt.schedule(...).
    bad = []
    for s in all_spans(("code",)):
        # a diff: the loop after the change (removed lines blanked, so line numbers hold)
        lines = [("" if ln.startswith("-") else ln[1:]) if s.lang == "diff" else ln for ln in s.text.split("\n")]
        body = "\n".join(lines)
        if "opt.backward(" not in body or "opt.step(" not in body:
            continue
        schedulers = set()
        for m in re.finditer(r"^\s*(\w+)\s*=\s*(.*lr_scheduler\.\w+\(.*)$", body, re.MULTILINE):
            schedulers.add(m.group(1))
            if "opt.schedule(" not in m.group(2):
                bad.append((s.where(m.start()), f"{m.group(1)} = {m.group(2).strip()[:60]} (use opt.schedule(...))"))
        steps = re.finditer(r"^\s*(\w+)\.step\(\)", body, re.MULTILINE)
        bad += [(s.where(m.start()), m.group(0).strip()) for m in steps if m.group(1) in schedulers]
    assert not bad, f"guarded loops whose LR scheduler steps on skipped steps: {bad}"


# ---------------------------------------------------------------------------------- the checks bite
PLANTED = {
    "test_config_fields_named_in_the_docs_are_guard_config_fields": (
        "Use `GuardConfig(max_consecutive_skip=5)` or `config={\"hysterisis\": 2}`.\n", "max_consecutive_skip"),
    "test_the_configuration_table_has_every_field_with_its_default": (
        "| field | default | meaning |\n|---|---|---|\n| `hysteresis` | 2 | back off later |\n", "default 2"),
    "test_lists_of_reasons_kinds_phases_and_causes_are_the_vocabulary": (
        "`reason` (`nonfinite_loss` | `nonfinite_grad` | `grad_spik`)\n", "grad_spik"),
    "test_label_values_and_table_cells_are_the_vocabulary": ('`Anomaly(kind="overflw")`\n', "overflw"),
    "test_record_fields_named_in_the_docs_exist": ("`StepReport.grad_nrm`\n", "grad_nrm"),
    "test_error_names_are_importable_from_ampguard_and_the_errors_table_is_complete": (
        "## Errors\n\n| error | when |\n|---|---|\n| `GuardStatError` | never |\n", "GuardStatError"),
    "test_metric_alert_and_recording_rule_names_are_the_catalogues": (
        "`ampguard_skiped_steps_total`, `AmpguardNonFinitBurst`, `job:ampguard_steps:rate1m`\n", "skiped"),
    "test_ampguard_names_the_docs_call_or_import_exist": (
        "```python\nfrom ampguard import wrap, GuardCofnig\nampguard.warp(opt)\n```\n", "GuardCofnig"),
    "test_attributes_of_the_guarded_optimizer_the_docs_use_exist": (
        "`opt.history.steps_reportd` and `opt.skiped_steps`\n", "steps_reportd"),
    "test_command_lines_use_real_flags_and_the_command_table_has_every_flag": (
        "| command | what |\n|---|---|\n| `ampguard report RUN [--jsn]` | reads |\n", "--jsn"),
    "test_the_gathered_vector_is_as_wide_as_the_code_packs": (
        "Every rank all-gathers 7 floats: a `[world, 7]` matrix.\n", "[world, 7]"),
    "test_fault_values_in_examples_fit_fp16": (
        '```python\nfaults.output("blocks.3.mlp", 1e5, steps=[300])\n```\n', "1e5"),
    "test_hand_written_guarded_loops_step_the_lr_through_the_guard": (
        "```python\nsched = torch.optim.lr_scheduler.StepLR(opt, 10)\nfor x in data:\n    opt.backward(loss)\n"
        "    opt.step()\n    sched.step()\n```\n", "sched.step()"),
}


@pytest.mark.parametrize("check", sorted(PLANTED))
def test_each_check_catches_a_mistake_planted_in_a_doc(check, tmp_path, monkeypatch):
    text, named = PLANTED[check]
    doc = tmp_path / "planted.md"
    doc.write_text("# Planted\n\n" + text, encoding="utf-8")
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "DOCS", [doc])
    monkeypatch.setattr(module, "README", doc)
    test = getattr(module, check)
    args = {"label": "reason"} if check.startswith("test_lists_of") else {}
    with pytest.raises(AssertionError) as failed:
        test(**args)
    assert named in str(failed.value)
