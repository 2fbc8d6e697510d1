"""The metric names a PromQL expression selects (for the dashboard and alert-rule checks)."""

from __future__ import annotations

import re

# Names that PromQL reads as words but that are not metrics.
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"atan2", "inf", "nan", "start", "end"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
NAME_MATCHER = re.compile(r'__name__\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`)')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*(?![\w:])")
_COMMENT = re.compile(r"#[^\n]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Strings (label values), label matchers `{...}`, ranges `[...]`, grouping
    label lists (`by (...)`, `on (...)`, ...), function and aggregation names
    (followed by `(`), keywords and Grafana variables (`$x`) are not metric names.
    A `{__name__="..."}` matcher is one.
    """
    names: set[str] = set()
    for operator, quoted in NAME_MATCHER.findall(expr):
        if operator == "=":
            names.add(quoted[1:-1])
    text = _COMMENT.sub(" ", _STRING.sub('""', expr))
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    for match in _IDENTIFIER.finditer(text):
        word = match.group()
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names
