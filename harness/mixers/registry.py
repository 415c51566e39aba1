"""The mixers by name: the built-in ones, those registered with `register_mixer`, and those of installed packages
that declare an entry point in the group `harness.mixers` (`toy = my_package.module:ToyMixer`).

Entry points load once, on the first lookup or listing, so a command that never asks for a mixer imports no
plug-in. A plug-in that fails to load is left out with a warning naming its entry point and the error; asking for
it by name repeats that error (`MixerRegistry.failed`). docs/MIXERS.md is the worked example.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import is_dataclass
from typing import Optional

from harness.mixers.base import Mixer, MixerOptions

ENTRY_POINT_GROUP = "harness.mixers"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
BUILT_IN = "built-in"


class MixerRegistry(Mapping[str, type[Mixer]]):
    """name -> mixer class: the built-ins first, in their given order, then the plug-ins in registration order."""

    def __init__(self, builtins: Iterable[type[Mixer]]):
        self._classes: dict[str, type[Mixer]] = {}
        self._origins: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self._entry_points_loaded = False
        for cls in builtins:
            self.register(cls.name, cls, origin=BUILT_IN)
        self.builtins: tuple[str, ...] = tuple(self._classes)

    # ------------------------------------------------------------------ Mapping
    def __getitem__(self, name: str) -> type[Mixer]:
        self.load_entry_points()
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        self.load_entry_points()
        return iter(list(self._classes))

    def __len__(self) -> int:
        self.load_entry_points()
        return len(self._classes)

    def __repr__(self) -> str:
        return f"MixerRegistry({', '.join(self)})"

    # ------------------------------------------------------------------ registration
    def register(self, name: str, cls: type[Mixer], *, origin: str = "register_mixer") -> type[Mixer]:
        """Add `cls` under `name` (its `name` attribute is set to it where the class has none); registering the same
        class again changes nothing. Returns the class, so that this works as a decorator's body too."""
        check_mixer_class(name, cls)
        known = self._classes.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"mixer name '{name}' is taken by {qualified(known)} ({self._origins[name]}); "
                             f"{qualified(cls)} needs another name")
        if "name" not in vars(cls):
            cls.name = name
        self._classes[name] = cls
        self._origins.setdefault(name, origin)
        self._failed.pop(name, None)
        return cls

    def origin(self, name: str) -> str:
        """Where a mixer comes from: 'built-in', 'register_mixer', or its entry point and package."""
        self.load_entry_points()
        return self._origins[name]

    def failed(self) -> dict[str, str]:
        """Entry-point name -> why its plug-in is not available (empty when every plug-in loaded)."""
        self.load_entry_points()
        return dict(self._failed)

    def unknown_name_error(self, name: str) -> ValueError:
        """The error for a name no mixer has: the valid names, and a failed plug-in's error under that name."""
        why = self.failed().get(name)
        if why is not None:
            return ValueError(f"mixer '{name}' is a plug-in that failed to load: {why}. Valid mixers: "
                              f"{', '.join(self)}")
        return ValueError(f"unknown mixer '{name}'; valid mixers: {', '.join(self)}")

    # ------------------------------------------------------------------ entry points
    def load_entry_points(self) -> None:
        """Register every entry point of the group `harness.mixers`, once per process."""
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True  # first: a plug-in that looks mixers up while it imports must not recurse
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            self._load_entry_point(entry)

    def _load_entry_point(self, entry: importlib.metadata.EntryPoint) -> None:
        where = describe_entry_point(entry)
        try:
            cls = entry.load()
            if self._classes.get(entry.name) is cls:
                self._origins[entry.name] = where  # it registered itself while importing
                return
            self.register(entry.name, cls, origin=where)
        except Exception as exc:  # a broken plug-in must not break every command
            why = f"{where} failed: {type(exc).__name__}: {exc}"
            self._failed[entry.name] = why
            warnings.warn(f"harness: mixer plug-in left out: {why}", RuntimeWarning, stacklevel=3)


def check_mixer_class(name: str, cls: object) -> None:
    """A ValueError naming what is wrong, unless `cls` can be registered under `name`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"mixer name {name!r} is not allowed: lower-case letters, digits and '_', starting with a "
                         "letter (it is a config value and part of file names)")
    if not (isinstance(cls, type) and issubclass(cls, Mixer)):
        raise ValueError(f"mixer '{name}': {cls!r} is not a subclass of harness.mixers.Mixer")
    own = vars(cls).get("name")
    if own is not None and own != name:
        raise ValueError(f"mixer '{name}': {qualified(cls)}.name is '{own}'; register it under that name or "
                         "change the class attribute")
    options = getattr(cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, MixerOptions) and is_dataclass(options)):
        raise ValueError(f"mixer '{name}': {qualified(cls)}.Options is {options!r}; it must be a dataclass "
                         "subclassing harness.mixers.MixerOptions")


def describe_entry_point(entry: importlib.metadata.EntryPoint) -> str:
    dist: Optional[importlib.metadata.Distribution] = getattr(entry, "dist", None)
    package = f", package {dist.metadata['Name']} {dist.version}" if dist is not None else ""
    return f"entry point '{entry.name} = {entry.value}'{package}"


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
