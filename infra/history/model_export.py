"""`diloco model export`: a run's global model written as a checkpoint a user can load elsewhere.

Formats:
- safetensors: `model.safetensors`, the parameters by name, the run and versions in its header.
- torch: `model.pt`, a `state_dict` for `model.load_state_dict(torch.load(path))` (trainable
  parameters only: buffers such as BatchNorm statistics are not part of the global model).
- hf: the Hugging Face `save_pretrained` layout (config.json + model.safetensors), given the model's
  config (a directory or file holding its config.json); loads with `AutoModel*.from_pretrained`.

Every format gets `diloco-export.json` beside it: the run, each fragment's version and the sha256
its manifest records for its params (every params object is checked against it before it is written).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diloco.storage.global_model import GlobalModel, load_into

FORMATS = ("safetensors", "torch", "hf")
RECORD = "diloco-export.json"
HF_CLASSES = ("AutoModelForCausalLM", "AutoModel", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
              "AutoModelForSequenceClassification", "AutoModelForImageClassification")


def export_model(model: GlobalModel, out: Path, fmt: str, *, hf_config: Path | None = None,
                 hf_class: str = "AutoModelForCausalLM") -> list[Path]:
    """Write `model` under the directory `out` in `fmt`; returns the files written."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file
        written = [out / "model.safetensors"]
        save_file(state, str(written[0]), metadata=model.metadata())
    elif fmt == "torch":
        written = [out / "model.pt"]
        torch.save(state, written[0])
    else:
        written = _save_hf(model, out, hf_config, hf_class)
    record = out / RECORD
    record.write_text(json.dumps({"run": model.run, "versions": list(model.versions), "finished": model.finished,
                                  "params_sha256": list(model.params_sha256), "format": fmt,
                                  "tensors": len(state), "parameters": sum(t.numel() for t in state.values())},
                                 indent=2) + "\n")
    return [*written, record]


def _save_hf(model: GlobalModel, out: Path, hf_config: Path | None, hf_class: str) -> list[Path]:
    if hf_config is None:
        raise ValueError("--format hf needs the model's config: --hf-config DIR (a directory holding its "
                         "config.json, e.g. a save_pretrained checkpoint of the model trained)")
    if hf_class not in HF_CLASSES:
        raise ValueError(f"--hf-class must be one of {', '.join(HF_CLASSES)}, got {hf_class!r}")
    try:
        import transformers
    except ImportError:
        raise ValueError("--format hf needs transformers: pip install 'diloco[hf]'") from None
    config = transformers.AutoConfig.from_pretrained(str(hf_config), local_files_only=True)
    hf_model = getattr(transformers, hf_class).from_config(config)
    load_into(hf_model, model.state)  # every trainable parameter named and shaped as in the run, or refused
    hf_model.save_pretrained(str(out), safe_serialization=True)
    return sorted(p for p in out.iterdir() if p.name != RECORD)
