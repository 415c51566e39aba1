"""The token mixers, by name (linear-time, but for fox and path: softmax attention with a forget gate, and with
Householder transforms of its keys). `MIXERS[name]` is the layer class: the built-in mixers below, in this order, then
plug-ins (`register_mixer`, or an installed package's entry point in the group `harness.mixers`;
harness.mixers.registry, docs/MIXERS.md)."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Mapping

from harness.mixers.base import Mixer, MixerOptions, MixerShape, MixerState, no_weight_decay
from harness.mixers.deltanet import DeltaNet
from harness.mixers.deltaproduct import DeltaProduct
from harness.mixers.fox import Fox
from harness.mixers.gated_deltanet import GatedDeltaNet
from harness.mixers.gla import GLA
from harness.mixers.gsa import GSA
from harness.mixers.hedgehog import Hedgehog
from harness.mixers.kda import KDA
from harness.mixers.kernel_case import KernelCase
from harness.mixers.linear_attn import LinearAttention
from harness.mixers.mamba2 import Mamba2
from harness.mixers.mlstm import MLSTM
from harness.mixers.path import Path
from harness.mixers.registry import MixerRegistry
from harness.mixers.retnet import RetNet
from harness.mixers.rwkv7 import RWKV7

MIXERS: MixerRegistry = MixerRegistry(
    cls for cls in (LinearAttention, RetNet, GLA, DeltaNet, GatedDeltaNet, KDA, MLSTM, DeltaProduct, Mamba2,
                    Hedgehog, GSA, RWKV7, Fox, Path)
)


def register_mixer(name: str, cls: type[Mixer]) -> type[Mixer]:
    """Make `cls` (a `Mixer` subclass) the mixer `name` in this process: every function that takes a mixer name
    finds it. For every command (each stage runs in a process of its own), declare it as an entry point instead
    (docs/MIXERS.md). A ValueError names what is wrong: the name's form, a name taken by another class, a class that
    is no Mixer."""
    return MIXERS.register(name, cls)


def mixer_class(name: str) -> type[Mixer]:
    """The class of mixer `name`; a ValueError lists the valid names (and a failed plug-in's error)."""
    if name not in MIXERS:
        raise MIXERS.unknown_name_error(name)
    return MIXERS[name]


def mixer_options(name: str, options: Mapping[str, Any] | None = None) -> MixerOptions:
    """Build and check a mixer's options; unknown keys raise ValueError listing the allowed ones."""
    cls = mixer_class(name).Options
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(options or {}) - set(allowed))
    if unknown:
        listing = "; ".join(f"{n} ({f.metadata.get('help', '')})" for n, f in allowed.items())
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for mixer '{name}'. Allowed: {listing}")
    return cls(**dict(options or {}))


# What the init options were before they existed (until 2026-12-01, docs/TRANSFER.md "Compatibility"). Students and
# run records written since hold every option; one that lacks a key was made under this value.
LEGACY_OPTION_VALUES = {"conv_init": "random", "qkv_activation": "silu", "gate_init": "random", "output_scale": "none"}


def resolved_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every option of a mixer, given or default (what a student's config and a run's records store)."""
    return asdict(mixer_options(name, options))


def saved_options(name: str, saved: Mapping[str, Any] | None) -> MixerOptions:
    """The options a saved student or run record was made under: its keys, and for an init option it lacks, that
    option's value before it existed (LEGACY_OPTION_VALUES); everything else at its default."""
    allowed = {f.name for f in fields(mixer_class(name).Options)}
    legacy = {k: v for k, v in LEGACY_OPTION_VALUES.items() if k in allowed}
    return mixer_options(name, {**legacy, **dict(saved or {})})


def describe_options(name: str) -> list[tuple[str, Any, str]]:
    """(option, default, description) for each option of a mixer."""
    return [(f.name, f.default, f.metadata.get("help", "")) for f in fields(mixer_class(name).Options)]


__all__ = ["LEGACY_OPTION_VALUES", "MIXERS", "KernelCase", "Mixer", "MixerOptions", "MixerShape", "MixerState",
           "mixer_class", "mixer_options", "describe_options", "no_weight_decay", "register_mixer", "resolved_options",
           "saved_options"]
