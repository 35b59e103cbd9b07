"""Hugging Face causal LMs built from a config alone: ``--model hf:NAME_OR_PATH``.

``hilore trace`` and ``hilore calibrate`` take ``hf:`` plus a local folder with
a ``config.json``, a local ``.json`` config file, the name of a config
shipped with the package (``qwen2.5-0.5b``, ``qwen2.5-3b``, ``llama-3.2-1b``:
``BUNDLED_CONFIGS``), or a hub name (which the user's transformers resolves;
that fetches the config only). No weights are
ever loaded: the model is built on the meta device for roofline traces and
with seeded random weights on the CPU for measured ones, attention ``sdpa``,
``use_cache`` and dropout off. ``--layers N`` cuts a deep model to N layers so
that it fits a CPU, and ``--lora R`` wraps it with PEFT's LoRA, so that only
the adapters are trained. Needs ``transformers`` and, for LoRA, ``peft`` (the
``hf`` extra); both are imported only when a model is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: What marks a ``--model`` value as a Hugging Face config rather than a built-in name.
HF_PREFIX = "hf:"

#: Configs shipped with the package, by the name ``hf:NAME`` gives them: the
#: published widths of models people fine-tune with GRPO (the paper's
#: Qwen2.5-3B among them), so that real widths need no network.
BUNDLED_CONFIGS = Path(__file__).parent / "configs"

#: LoRA's target modules by default: every projection of a Llama / Qwen2 /
#: Mistral decoder layer (attention and SwiGLU MLP), as LoRA fine-tunes of them commonly set.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class HFModelSpec:
    """Which Hugging Face causal LM to build, and how (``parse_model_arg``)."""

    #: A local folder with ``config.json``, a local ``.json`` file, a bundled config's name, or a hub name.
    name_or_path: str
    #: Keep only the first this many decoder layers (None: all of the config's).
    layers: int | None = None
    #: LoRA rank; None trains every parameter (full fine-tuning).
    lora: int | None = None
    #: LoRA's alpha (None: twice the rank).
    lora_alpha: float | None = None
    #: The module names LoRA wraps (PEFT's ``target_modules``).
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    @property
    def alpha(self) -> float | None:
        """LoRA's alpha as used: given, or twice the rank; None without LoRA."""
        if self.lora is None:
            return None
        return 2.0 * self.lora if self.lora_alpha is None else float(self.lora_alpha)

    def describe(self, num_layers: int) -> str:
        """The model's name in a trace: ``hf:NAME (36 layers, LoRA r=16 on q,k,v,o,gate,up,down)``."""
        parts = [f"{num_layers} layers"]
        if self.lora is not None:
            short = ",".join(t.removesuffix("_proj") for t in self.lora_targets)
            parts.append(f"LoRA r={self.lora} on {short}")
        return f"{HF_PREFIX}{self.name_or_path} ({', '.join(parts)})"

    def ref(self) -> str:
        """One string naming this spec, options included, that ``parse_model_ref`` reads back:
        ``hf:PATH`` or ``hf:PATH?layers=4&lora=16&alpha=32&targets=q_proj,v_proj``.

        Benchmarks pass it to their worker processes as the model's name.
        """
        options = {"layers": self.layers, "lora": self.lora, "alpha": self.lora_alpha}
        query = [f"{k}={v:g}" for k, v in options.items() if v is not None]
        if self.lora is not None and self.lora_targets != DEFAULT_LORA_TARGETS:
            query.append(f"targets={','.join(self.lora_targets)}")
        return f"{HF_PREFIX}{self.name_or_path}" + (f"?{'&'.join(query)}" if query else "")

    def slug(self) -> str:
        """A file-name-safe short name: ``hf-qwen25-3b-l4-lora16``."""
        stem = Path(self.name_or_path.rstrip("/")).name.removesuffix(".json").lower()
        parts = [re.sub(r"[^a-z0-9]+", "", stem) or "model"]
        if self.layers is not None:
            parts.append(f"l{self.layers}")
        if self.lora is not None:
            parts.append(f"lora{self.lora}")
        return "hf-" + "-".join(parts)


def is_hf_model(name: str) -> bool:
    """Whether a ``--model`` value names a Hugging Face config (``hf:...``)."""
    return name.startswith(HF_PREFIX)


def parse_model_arg(text: str, *, layers: int | None = None, lora: int | None = None,
                    lora_alpha: float | None = None,
                    lora_targets: tuple[str, ...] | None = None) -> HFModelSpec:
    """``"hf:NAME_OR_PATH"`` and the options that shape it -> an ``HFModelSpec``.

    Raises:
        ValueError: not ``hf:...``, an empty name, a layer count or rank below 1,
            a non-positive alpha or no LoRA targets.
    """
    if not is_hf_model(text) or not text[len(HF_PREFIX):].strip():
        raise ValueError(f"expected hf:NAME_OR_PATH (a config folder, a .json config, a bundled name such as qwen2.5-0.5b, or a hub name), got {text!r}")
    for flag, value in (("--layers", layers), ("--lora", lora)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if lora_alpha is not None and not lora_alpha > 0:
        raise ValueError(f"--lora-alpha must be positive, got {lora_alpha}")
    targets = DEFAULT_LORA_TARGETS if lora_targets is None else tuple(lora_targets)
    if not targets:
        raise ValueError("--lora-targets names no module")
    return HFModelSpec(name_or_path=text[len(HF_PREFIX):].strip(), layers=layers, lora=lora,
                       lora_alpha=lora_alpha, lora_targets=targets)


#: The options ``HFModelSpec.ref`` writes after ``?``.
_REF_OPTIONS = ("layers", "lora", "alpha", "targets")


def parse_model_ref(text: str) -> HFModelSpec:
    """``HFModelSpec.ref``'s string (or a plain ``hf:NAME_OR_PATH``) -> the spec.

    Raises:
        ValueError: not ``hf:...``, an option ``ref`` never writes, or a bad value.
    """
    name, sep, query = text.partition("?")
    if not sep or not query:
        return parse_model_arg(text)
    options: dict[str, str] = {}
    for item in query.split("&"):
        key, _, value = item.partition("=")
        if key not in _REF_OPTIONS or not value:
            raise ValueError(f"{text!r}: unknown model option {item!r}; options: "
                             f"{', '.join(o + '=...' for o in _REF_OPTIONS)}")
        options[key] = value
    try:
        return parse_model_arg(
            name, layers=int(options["layers"]) if "layers" in options else None,
            lora=int(options["lora"]) if "lora" in options else None,
            lora_alpha=float(options["alpha"]) if "alpha" in options else None,
            lora_targets=tuple(options["targets"].split(",")) if "targets" in options else None)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None


def load_config(spec: HFModelSpec) -> Any:
    """The ``transformers`` config of ``spec``, cut to ``spec.layers``, cache and dropout off.

    A ``.json`` file is read here (its ``model_type`` picks the config class);
    a folder or a hub name goes to ``AutoConfig.from_pretrained`` as given.
    """
    transformers = _transformers()
    path = config_path(spec.name_or_path)
    if path.is_file():
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
        if not model_type:
            raise ValueError(f"{path}: a config .json needs a 'model_type' (such as 'qwen2' or 'llama')")
        config = transformers.AutoConfig.for_model(model_type, **fields)
    else:
        config = transformers.AutoConfig.from_pretrained(str(path) if path.is_dir() else spec.name_or_path)
    if spec.layers is not None:
        _cut_layers(config, spec.layers)
    config.use_cache = False
    # Dropout would make recomputation draw new masks and gradients differ run to run.
    for name, value in config.to_dict().items():
        if name.endswith(("dropout", "pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def bundled_names() -> list[str]:
    """The names of the configs shipped with the package (``BUNDLED_CONFIGS``)."""
    return sorted(p.stem for p in BUNDLED_CONFIGS.glob("*.json"))


def config_path(name_or_path: str) -> Path:
    """Where ``hf:NAME_OR_PATH``'s config is read from: a local path as given,
    else a bundled config of that name (``qwen2.5-0.5b``, case ignored), else
    the name itself (a hub name, which ``AutoConfig`` resolves)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    bundled = BUNDLED_CONFIGS / f"{name_or_path.lower()}.json"
    return bundled if bundled.is_file() else path


def _transformers() -> Any:
    """The ``transformers`` module, or an error that says which extra brings it."""
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise RuntimeError("--model hf:... needs transformers: pip install 'hilore-compiler[hf]'") from e
    return transformers


def _cut_layers(config: Any, layers: int) -> None:
    """Keep the first ``layers`` decoder layers (and their entries of ``layer_types``)."""
    total = getattr(config, "num_hidden_layers", None)
    if total is None:
        raise ValueError(f"--layers: the {type(config).__name__} has no num_hidden_layers to cut")
    if layers > total:
        raise ValueError(f"--layers {layers} is more than the config's {total} layers")
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]


def build_from_config(spec: HFModelSpec, config: Any, *, device: torch.device | str = "cpu",
                      dtype: torch.dtype | None = None, seed: int = 0) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on ``device``, LoRA-wrapped if ``spec.lora``.

    On ``"meta"`` nothing is allocated (PEFT creates the adapters on the
    device of the layer they wrap, so they are meta too); elsewhere the
    weights are random, a function of ``seed``, and the caller's RNG is left as it was.
    """
    transformers = _transformers()
    device = torch.device(device)
    # transformers 4.56 renamed from_config's ``torch_dtype`` to ``dtype``.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    extra = {dtype_key: dtype} if dtype is not None else {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **extra)
        if spec.lora is not None:
            model = _with_lora(model, spec, random_init=device.type != "meta")
    return model.train()


def _with_lora(model: torch.nn.Module, spec: HFModelSpec, *, random_init: bool) -> torch.nn.Module:
    """The model with LoRA of ``spec`` injected by ``peft.get_peft_model``: the base
    weights frozen, the adapters trained.

    The model itself is returned, not PEFT's wrapper: for LoRA the wrapper's
    forward only calls it, and its module paths would put
    ``__dict__._modules.base_model...`` at the head of every unit key.
    PEFT keeps the adapters in float32 under a bf16 base (its
    ``autocast_adapter_dtype``), as LoRA training usually runs.
    ``random_init``: random A and B (PEFT's ``init_lora_weights=False``)
    rather than B = 0, which would leave every A's gradient zero in the
    measured step and in calibration's gradient comparison.
    """
    try:
        import peft
    except ModuleNotFoundError as e:
        raise RuntimeError("--lora needs peft: pip install 'hilore-compiler[hf]'") from e
    config = peft.LoraConfig(r=spec.lora, lora_alpha=spec.alpha, lora_dropout=0.0,
                             target_modules=list(spec.lora_targets),
                             init_lora_weights=not random_init)
    return peft.get_peft_model(model, config).get_base_model()
