"""`orbit model import SRC OUT`: a GGUF file or a Hugging Face checkpoint directory, written as a
plain checkpoint directory that Orbit, peft, transformers and SGLang all load.

transformers (with the `gguf` package) reads and dequantizes a GGUF file; Orbit writes no
dequantizer of its own. What is written: `model.safetensors` in the chosen dtype, a `config.json`
with no quantization entry (transformers' `save_pretrained` refuses a model that still says it is
quantized, and every loader would try to quantize again), the tokenizer with its chat template, and
the generation config (its eos is the model's end-of-turn token). It goes to a temporary directory
next to OUT first and is renamed into place, so OUT is never half written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orbit.host.files import write_dir

DTYPES = ("float32", "bfloat16", "float16")


class ImportError_(ValueError):
    """A source that cannot be imported; the message names the file and why, in one line."""


@dataclass
class Imported:
    out: Path
    params: int
    dtype: str
    source: str  # what was read: "GGUF MOSTLY_Q4_1", "safetensors (bfloat16)", ...
    model_type: str

    def line(self) -> str:
        return (
            f"wrote {self.out}: {self.model_type}, {self.params / 1e6:.1f} M parameters, "
            f"{self.dtype}, from {self.source}"
        )


def gguf_quantization(path: Path) -> str:
    """The GGUF file's quantization (its `general.file_type`, e.g. MOSTLY_Q4_1). ImportError_ when
    the file is not a GGUF file `gguf` can read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.file_type"]
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    except KeyError:
        return "unknown quantization"
    # gguf says why in its own words; the user needs one line
    except Exception as err:  # noqa: BLE001
        raise ImportError_(
            f"{path}: not a GGUF file gguf can read ({type(err).__name__}: {err})"
        ) from None


def import_model(src: Path, out: Path, dtype: str = "float32") -> Imported:
    """Read `src` (a .gguf file or a checkpoint directory) and write it to `out` as a plain
    checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from orbit.engine.embedded.model import SUPPORTED_MODEL_TYPES

    hf_logging.disable_progress_bar()  # the command says what it wrote in one line

    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ImportError_(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise ImportError_(
            f"{out}: already exists and is not empty; choose another OUT or remove it"
        )
    if src.is_file():
        source = f"GGUF {gguf_quantization(src)}"
        where, extra = src.parent, {"gguf_file": src.name}
    elif (src / "config.json").is_file():
        where, extra, source = src, {}, "a checkpoint directory"
    else:
        raise ImportError_(
            f"{src}: neither a GGUF file nor a checkpoint directory (with config.json)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **extra)
        tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    except Exception as err:  # noqa: BLE001 - transformers' reason, in one line
        raise ImportError_(
            f"{src}: transformers cannot read it ({type(err).__name__}: {err})".split("\n")[0]
        ) from None
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ImportError_(
            f"{src}: a {model_type!r} model; Orbit's engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _forget_quantization(model)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    write_dir(out, fill, replace=True)  # an existing `out` is empty (checked above)
    params = sum(p.numel() for p in model.parameters())
    return Imported(out, params, dtype, source, model_type)


def _forget_quantization(model) -> None:
    """A dequantized model is a plain one: no quantizer, no quantization entry in its config."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
