"""`harness mixers`: list the registered mixers (built-in and plug-in) with their options; `harness mixers check
NAME...`: run the mixer contract (harness.mixers.contract) and print each property's PASS / FAIL / SKIP."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

import yaml

from harness.config import ConfigError
from harness.mixers import MIXERS, describe_options
from harness.mixers.contract import FAIL, PROPERTIES, SKIP, run_contract
from harness.mixers.registry import BUILT_IN


def add_parser(sub: Any) -> argparse.ArgumentParser:
    mixers = sub.add_parser(
        "mixers", help="List the mixers (built-in and plug-in) and their options; `mixers check NAME` runs the "
        "mixer contract.",
        description="List the mixers and each one's options with defaults and descriptions: the built-in ones, "
        "then plug-ins (harness.register_mixer, or an installed package's entry point in the group harness.mixers; "
        "docs/MIXERS.md).")
    mixers.set_defaults(handler=cmd_mixers)
    what = mixers.add_subparsers(dest="mixers_command", metavar="check")
    check = what.add_parser(
        "check", help="Run the contract every built-in mixer passes.",
        description="Run the mixer contract on a tiny random Llama teacher (nothing is downloaded) and print each "
        "property: " + ", ".join(PROPERTIES) + ". Exit status 1 when any property fails.")
    check.add_argument("names", nargs="+", metavar="NAME", help="Mixer name(s), or 'all'.")
    check.add_argument("--options", default="", metavar="KEY=VALUE,...",
                       help="Mixer options for the check, e.g. rope=true,window=4 (default: the mixer's defaults).")
    check.add_argument("--only", default="", metavar="PROPERTY,...", help="Run only these properties.")
    check.set_defaults(handler=cmd_check)
    return mixers


def cmd_mixers(args: argparse.Namespace) -> int:
    for name, cls in MIXERS.items():
        doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().split("\n\n")[0]
        origin = MIXERS.origin(name)
        print(name + ("" if origin == BUILT_IN else f"  (plug-in: {origin})"))
        print(textwrap.indent(textwrap.fill(" ".join(doc.split()), 96), "    "))
        for opt, default, help_text in describe_options(name):
            print(textwrap.fill(f"{opt} = {default!r}: {help_text}", 110, initial_indent=" " * 6,
                                subsequent_indent=" " * 10))
    for name, why in MIXERS.failed().items():
        print(f"{name}  (plug-in NOT loaded: {why})")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    names = list(MIXERS) if args.names == ["all"] else args.names
    options, only = parse_options(args.options), [p.strip() for p in args.only.split(",") if p.strip()]
    failed = []
    for name in names:
        try:
            outcomes = run_contract(name, options, only=only)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        print(f"{name} ({MIXERS.origin(name)})" + (f" with {options}" if options else ""))
        for outcome in outcomes:
            print(f"  {outcome.status:<4}  {outcome.name:<38} {outcome.detail}")
        bad = [o.name for o in outcomes if o.status == FAIL]
        skipped = sum(o.status == SKIP for o in outcomes)
        print(f"  {len(outcomes)} properties: {len(outcomes) - len(bad) - skipped} passed, {len(bad)} failed "
              f"({', '.join(bad) or 'none'}), {skipped} skipped")
        failed += [f"{name}: {prop}" for prop in bad]
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def parse_options(text: str) -> dict[str, Any]:
    """'key=value,key=value' -> {key: value}, each value read as YAML (true, 4, 1e-3, random)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--options '{text}': '{part}' is not key=value (e.g. rope=true,window=4)")
        out[key.strip()] = yaml.safe_load(value.strip())
    return out
