"""Described fields and their rules: how a config section declares a field (`described`: its default, its
description, its `Rule`) and how a section is checked against them (`check_fields`), for the job's sections and an
evaluation spec's alike. `ConfigError` is the one error of a bad setting; the choice helpers name a choice field's
allowed values (the enums of harness.config_choices).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Callable, Optional

from harness.config_choices import Choice


class ConfigError(ValueError):
    """A job configuration problem, phrased for the user (the CLI exits with code 2)."""


@dataclass(frozen=True)
class Rule:
    """What a field's value must be, declared with the field and checked by `check_fields` (OmegaConf checks
    types and choices when it merges, but runs no `__post_init__`)."""

    holds: Callable[[Any], bool]
    must: str  # completes "KEY=VALUE must ..."
    each: bool = False  # for a list field: the rule is about each of its items

    def problem(self, key: str, value: Any) -> Optional[str]:
        """The message for `value` of `key` when the rule does not hold; None (an unset Optional) passes."""
        if value is None:
            return None
        if self.each:
            bad = [item for item in value if not self.holds(item)]
            return f"Bad value {bad[0]!r} in {key}: each must {self.must}." if bad else None
        shown = f"'{value}'" if isinstance(value, str) else value
        return None if self.holds(value) else f"{key}={shown} must {self.must}."


def each(rule: Rule) -> Rule:
    """`rule` for each item of a list field."""
    return replace(rule, each=True)


def at_least_zero(zero_means: str) -> Rule:
    return Rule(lambda n: n >= 0, f"be >= 0 (0: {zero_means})")


POSITIVE = Rule(lambda n: n > 0, "be a positive number")
FRACTION = Rule(lambda x: 0.0 <= x <= 1.0, "lie in [0, 1]")


def described(default: Any = None, help: str = "", factory: Any = None, rule: Optional[Rule] = None) -> Any:
    """A dataclass field with a description (shown by `harness info --explain`) and the Rule its value obeys."""
    metadata = {"help": help, "rule": rule}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def check_fields(node: Any, prefix: str = "") -> None:
    """Check each field of the dataclass `node` and of the dataclasses in it (lists of them too) against its Rule,
    that a float is finite (every float field's rule), and that a choice holds one of its values (OmegaConf checks
    that when it merges; a config built in code may hold any string). Raise ConfigError naming the first bad field,
    as `prefix` + its dotted key."""
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if is_dataclass(value):
            check_fields(value, f"{key}.")
            continue
        if _is_dataclass_list(value):
            for i, item in enumerate(value):
                check_fields(item, f"{key}[{i}].")
            continue
        rule = _rule_of(type(node), f.name)
        problem = (_choice_problem(key, value, hints[f.name]) or _not_finite(key, value)
                   or (rule and rule.problem(key, value)))
        if problem:
            raise ConfigError(problem)


def _is_dataclass_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(is_dataclass(v) for v in value)


def _not_finite(key: str, value: Any) -> Optional[str]:
    """The rule of every float field (and list of floats): its values are finite, neither inf nor nan."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        return f"{key}={value} must be a finite number (not inf or nan)."
    return None


def _rule_of(cls: type, name: str) -> Optional[Rule]:
    """The Rule of field `name` of `cls`; a field that a subclass declares again (a new default) keeps the
    Rule of the base class it overrides."""
    for klass in cls.__mro__:
        declared = {f.name: f for f in fields(klass)} if is_dataclass(klass) else {}
        if name in declared and declared[name].metadata.get("rule"):
            return declared[name].metadata["rule"]
    return None


def _choice_problem(key: str, value: Any, hint: Any) -> Optional[str]:
    choice = _choice_type(hint)
    if choice is None:
        return None
    bad = [v for v in (value if isinstance(value, list) else [value]) if v not in choice.values()]
    return bad_choice(key, bad[0], choice) if bad else None


def choice_of_field(root: type, dotted: str) -> Optional[type[Choice]]:
    """The Choice enum of the field at `dotted` under the dataclass `root` (one of a list's items, as in
    'eval.niah.kinds[1]', counts), or None when that field is no choice."""
    hint: Any = root
    for part in without_index(dotted).split("."):
        hints = typing.get_type_hints(hint) if is_dataclass(hint) else {}
        if part not in hints:
            return None
        hint = unwrap_optional(hints[part])  # an Optional section (eval.state) holds the dataclass' fields
    return _choice_type(hint)


def unwrap_optional(hint: Any) -> Any:
    """X of Optional[X]; any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _choice_type(hint: Any) -> Optional[type[Choice]]:
    """The Choice enum that a field's type hint names (Optional[X] and list[X] name X), or None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, typing.Union) and len(args) == 1:
        hint = args[0]
    return hint if isinstance(hint, type) and issubclass(hint, Choice) else None


def without_index(key: str) -> str:
    """`key` without its list indices ('eval.niah.kinds[1]' -> 'eval.niah.kinds')."""
    return re.sub(r"\[\d+\]", "", key)


def bad_choice(key: str, value: Any, choice: type[Choice], where: str = "") -> str:
    """The message for a value of `key` that is none of `choice`'s values."""
    return f"Bad value '{value}' for {key}{where}. Allowed: {', '.join(choice.values())}."

