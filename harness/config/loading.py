"""Loading a job: a YAML file and dotted `key=value` overrides merged onto the typed defaults (whole numbers given
as floats turned into ints), then validated; OmegaConf's errors explained as one paragraph naming the key; the
description of a field (`field_help`) and the YAML of a job (`to_yaml`)."""

from __future__ import annotations

import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config.data import MixSourceConfig
from harness.config.evaluation import keys_under
from harness.config.fields import ConfigError, bad_choice, choice_of_field, unwrap_optional, without_index
from harness.config.job import JobConfig
from harness.config.training import LossTermConfig
from harness.config.validation import validate
from harness.config_choices import DistillLoss


def load_job(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Merge a YAML job file and dotted `key=value` overrides onto the defaults, then validate."""
    schema = OmegaConf.structured(JobConfig)
    layers = [schema]
    if path is not None:
        layers.append(whole_numbers(_read_yaml(Path(path)), JobConfig, f" (in {path})"))
    layers.append(whole_numbers(_parse_overrides(overrides), JobConfig, " (on the command line)"))
    try:
        merged = OmegaConf.merge(*layers)
        with keys_under("eval."):  # eval.copy and eval.state check themselves as they are built
            job = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain_omegaconf(err, path)) from None
    except TypeError as err:  # OmegaConf's own, for a mapping merged onto a list (e.g. `key=auto:` reads as {auto: null})
        raise ConfigError(f"A value of {path or 'the overrides'} ({', '.join(overrides) or 'none'}) has the wrong kind "
                          f"for its field ({err}); quote a string that contains ':' (key='a:b').") from None
    validate(job)
    return job


def _read_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"Job file '{path}' does not exist. Pass a YAML job file such as jobs/quickstart.yaml.")
    try:
        return OmegaConf.load(path)
    except Exception as err:  # yaml errors come in several types
        raise ConfigError(f"Job file '{path}' is not valid YAML: {err}") from None


def _parse_overrides(overrides: list[str]):
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(
            f"Override '{bad[0]}' is not of the form key=value (dotted keys, e.g. student.mixer=gla "
            "or stages.distill.lr=3e-4)."
        )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"Could not parse the overrides {list(overrides)}: {err.msg}") from None


def whole_numbers(layer: Any, schema: type, where: str = "") -> Any:
    """A YAML or override layer (a DictConfig) with each float given for an int field of the dataclass `schema` turned
    into that int where it is a whole number (budget.total_tokens=1e9 or 2.5e7: YAML and the command line read those
    as floats, which OmegaConf would refuse); ConfigError naming the key where it is not. Interpolations stay."""
    tree = OmegaConf.to_container(layer, resolve=False)
    if not isinstance(tree, dict):  # a YAML list: the merge names the problem
        return layer
    _whole_numbers_in(tree, schema, "", where)
    return OmegaConf.create(tree)


def _whole_numbers_in(tree: dict, schema: type, prefix: str, where: str) -> None:
    """`whole_numbers` on a plain dict, in place, against the fields of the dataclass `schema`."""
    hints = typing.get_type_hints(schema)
    for key, value in tree.items():
        hint = unwrap_optional(hints.get(key))
        item = unwrap_optional(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else None
        if is_dataclass(hint) and isinstance(value, dict):
            _whole_numbers_in(value, hint, f"{prefix}{key}.", where)
        elif hint is int:
            tree[key] = _whole_number(f"{prefix}{key}", value, where)
        elif isinstance(value, list) and (item is int or is_dataclass(item)):
            for i, v in enumerate(value):
                if is_dataclass(item) and isinstance(v, dict):
                    _whole_numbers_in(v, item, f"{prefix}{key}[{i}].", where)
                elif item is int:
                    value[i] = _whole_number(f"{prefix}{key}[{i}]", v, where)


def _whole_number(key: str, value: Any, where: str) -> Any:
    """`value` of the int field `key`: a float that is a whole number as that int; another float refused."""
    if not isinstance(value, float):
        return value
    if not value.is_integer():
        raise ConfigError(f"{key}={value}{where} must be a whole number, e.g. 1000000000 or 1e9.")
    return int(value)


def _explain_omegaconf(err: OmegaConfBaseException, path) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(getattr(err, "msg", err)).splitlines()[0]
    where = f" (in {path} or the overrides)" if path else ""
    if getattr(err, "object_type", None) is LossTermConfig:  # OmegaConf's key for a list entry has lost its path
        if key == "name":
            return bad_choice("stages.distill.losses[*].name", getattr(err, "value", "?"), DistillLoss)
        return f"Bad entry in stages.distill.losses{where}: {msg} (an entry's keys: name, weight, temperature)."
    if getattr(err, "object_type", None) is MixSourceConfig:  # the same for a data.mix entry
        return (f"Bad entry in data.mix{where}: {msg} (an entry's keys: source, weight, stage_weights, text_field, "
                "options).")
    parent, _, leaf = key.rpartition(".")
    if "not in" in msg:
        allowed = _allowed_keys(parent)
        return f"Unknown key '{key}'{where}. Allowed keys under '{parent or 'the top level'}': {allowed}."
    choice = choice_of_field(JobConfig, key)
    if choice is not None:
        return bad_choice(without_index(key), getattr(err, "value", "?"), choice)
    expected = _field_type(key)
    return f"Bad value for '{key}'{where}: {msg}. Expected {expected}."



def _node_for(dotted: str) -> Any:
    node: Any = JobConfig()
    for part in [p for p in dotted.split(".") if p]:
        if not is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def _allowed_keys(parent: str) -> str:
    node = _node_for(parent)
    if not is_dataclass(node):
        return "(none)"
    return ", ".join(f.name for f in fields(node))


def _field_type(key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    node = _node_for(parent)
    if is_dataclass(node):
        for f in fields(node):
            if f.name == leaf:
                return f"{f.type}: {f.metadata.get('help', '')}"
    return "a value of the declared type"


def field_help(dotted: str) -> str:
    """The description of a config field, e.g. field_help('stages.distill.temperature')."""
    parent, _, leaf = dotted.rpartition(".")
    node = _node_for(parent)
    for f in fields(node):
        if f.name == leaf:
            return f.metadata.get("help", "")
    raise KeyError(dotted)


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))
