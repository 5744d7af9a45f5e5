"""The job selector of the rules (PromQL label matchers, parsed and checked) and the labels of the
rule tests' synthetic series, which must match it."""

from __future__ import annotations

import dataclasses
import json
import re

#: The rule tests' job label when neither ``test_job`` nor a ``job="..."`` matcher names one.
DEFAULT_TEST_JOB = "train"


@dataclasses.dataclass(frozen=True)
class Matcher:
    """One PromQL label matcher of a job selector: ``name op "value"``."""

    name: str
    op: str
    """``=``, ``!=``, ``=~`` or ``!~``."""
    value: str
    """The string's value (escapes resolved)."""

    def matches(self, value: str) -> bool:
        """Does a series whose label ``name`` is ``value`` ("" where it has none) match? Regular
        expressions are fully anchored, as in Prometheus (Python's ``re`` stands in for RE2)."""
        if self.op in ("=", "!="):
            return (value == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, value) is not None) == (self.op == "=~")

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value)}"


_TOKEN = re.compile(r"""\s*(?:
    (?P<name>[A-Za-z_][A-Za-z0-9_]*|"(?:[^"\\]|\\.)*")\s*(?P<op>=~|!~|!=|=)\s*
    (?P<value>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)\s*
    (?P<sep>,|$))""", re.VERBOSE)
_ESCAPE = re.compile(r"\\(?:([abfnrtv\\'\"])|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|([0-7]{3})|(.))",
                     re.DOTALL)
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _unquote(token: str) -> str:
    """A PromQL string literal's value: Go's escapes in "..." and '...', none in `...`."""
    if token[0] == "`":
        return token[1:-1]

    def escape(m: re.Match[str]) -> str:
        simple, hex2, hex4, hex8, octal, bad = m.groups()
        if bad is not None:
            raise ValueError(f"unknown escape sequence \\{bad} in {token}")
        if simple is not None:
            return _SIMPLE_ESCAPES.get(simple, simple)
        return chr(int(hex2 or hex4 or hex8, 16) if octal is None else int(octal, 8))

    return _ESCAPE.sub(escape, token[1:-1])


def parse_selector(selector: str) -> tuple[Matcher, ...]:
    """The label matchers of a job selector, the inside of a PromQL ``{...}``: ``name op "value"``
    separated by commas, e.g. ``'job=~"llm-.*", cluster="a"'`` ("" or blanks: none). Raises
    ``ValueError`` saying what is wrong and where, with an example of the syntax."""
    if not isinstance(selector, str):
        raise ValueError(f"job_selector={selector!r}; allowed: a string of PromQL label matchers")
    matchers: list[Matcher] = []
    pos = 0
    while selector[pos:].strip():
        m = _TOKEN.match(selector, pos)
        if m is None:
            braces = " (without the braces)" if selector.strip().startswith("{") else ""
            raise ValueError(
                f"job_selector {selector!r} is not a list of PromQL label matchers{braces} (at {selector[pos:]!r}); "
                'allowed: name op "value", ... with op one of = != =~ !~, e.g. \'job=~"llm-.*"\' or \'job="llm"\''
            )
        name = m["name"]
        try:
            matcher = Matcher(_unquote(name) if name[0] == '"' else name, m["op"], _unquote(m["value"]))
        except ValueError as exc:
            raise ValueError(f"job_selector {selector!r}: {exc}") from None
        if matcher.op in ("=~", "!~"):
            try:
                re.compile(matcher.value)
            except re.error as exc:
                raise ValueError(f"job_selector {selector!r}: {matcher} is not a valid regular expression ({exc})"
                                 ) from None
        matchers.append(matcher)
        pos = m.end()
        if m["sep"] == "":
            break
    return tuple(matchers)


def _test_job(selector: str, test_job: str | None) -> str:
    """The job label of the rule tests' series: ``test_job``, else the value of the selector's
    ``job="..."`` matcher, else "train". Checked: the rule tests' synthetic series (labels
    job, instance, rank, local_rank) must match every matcher of the selector, or the generated
    tests would fail under promtool."""
    matchers = parse_selector(selector)
    if test_job is None:
        test_job = next((m.value for m in matchers if m.name == "job" and m.op == "="), DEFAULT_TEST_JOB)
    ranks = [_rank_labels(test_job, r) for r in (0, 1)]
    labels = ranks[0]
    for matcher in matchers:
        if all(matcher.matches(rank.get(matcher.name, "")) for rank in ranks):
            continue
        if matcher.name == "job":
            raise ValueError(f"test_job={test_job!r} (--test-job) does not match {matcher} of job_selector "
                             f"{selector!r}: the rule tests' series would not reach the rules; pass a job name the "
                             "selector matches")
        raise ValueError(f"job_selector {selector!r}: {matcher} does not match the rule tests' series, which carry "
                         f"only the labels {', '.join(labels)}; select on those (e.g. job) so the generated tests "
                         "can exercise the rules")
    return test_job


def _rank_labels(job: str, rank: int) -> dict[str, str]:
    """The labels of rank ``rank``'s series in the rule tests."""
    return {"job": job, "instance": f"node0:{9400 + rank}", "rank": str(rank), "local_rank": str(rank)}


def _sel(metric: str, selector: str) -> str:
    return f"{metric}{{{selector}}}" if selector else metric
