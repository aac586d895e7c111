"""A peft LoRA adapter as a GGUF adapter file, for llama.cpp (the CPU engine).

llama.cpp loads LoRA adapters in GGUF: ``general.type = adapter``, ``adapter.type = lora``,
``adapter.lora.alpha``, and per adapted weight two tensors, ``<gguf name>.lora_a`` (peft's A, rank x in) and
``<gguf name>.lora_b`` (peft's B, out x rank), under llama.cpp's tensor names (``blk.N.attn_q.weight``...).
This is what llama.cpp's ``convert_lora_to_gguf.py`` writes; that script is not shipped with llama-cpp-python,
so this module writes the same with the ``gguf`` package. The file is cached beside the adapter
(``adapter.gguf``) and rewritten when the adapter's weights are newer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from stam.errors import WeightsError
from stam.llm.weights import cache_dir

GGUF_NAME = "adapter.gguf"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def default_out(adapter: Path) -> Path:
    """Where the converted adapter goes: beside it, or, where that folder is read-only (a mounted volume in a
    container with a read-only root), in a writable cache named after the folder's path."""
    if os.access(adapter, os.W_OK):
        return adapter / GGUF_NAME
    key = hashlib.sha256(str(adapter.resolve()).encode()).hexdigest()[:16]
    for root in (cache_dir() / "loras", Path(tempfile.gettempdir()) / "stam-loras"):
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root / f"{adapter.name}-{key}.gguf"
    raise WeightsError(f"{adapter}: read-only, and no writable cache for its GGUF conversion (set STAM_MODEL_CACHE)")


def to_gguf(adapter: Path, out: Path | None = None, *, arch: str = "qwen2") -> Path:
    """Convert the peft adapter folder ``adapter`` (safetensors) to GGUF; returns the file (``default_out``
    unless ``out`` is given; an existing conversion newer than the weights is reused)."""
    # deferred: optional gguf (stam[train]), not installed everywhere; numpy, safetensors are slow to import
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    adapter = Path(adapter)
    weights = adapter / "adapter_model.safetensors"
    config_path = adapter / "adapter_config.json"
    if not weights.is_file() or not config_path.is_file():
        raise WeightsError(f"{adapter}: not a peft adapter folder (adapter_config.json, adapter_model.safetensors)")
    out = out or default_out(adapter)
    if out.is_file() and out.stat().st_mtime >= weights.stat().st_mtime:
        return out
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("modules_to_save"):
        raise WeightsError(f"{adapter}: only plain LoRA adapters convert to GGUF")
    tensors = load_file(str(weights))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise WeightsError(f"{adapter}: unexpected tensor {key}")
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    blocks = 1 + max(int(b) for b in re.findall(r"\.layers\.(\d+)\.", " ".join(pairs)) or ["0"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], blocks)
    writer = gguf.GGUFWriter(str(out.with_suffix(".tmp")), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for module, ab in sorted(pairs.items()):
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None or set(ab) != {"A", "B"}:
            raise WeightsError(f"{adapter}: {module} has no llama.cpp tensor name or lacks A/B")
        # bf16 is not a numpy dtype: safetensors.numpy gives it as float32 only when saved so; cast to f32.
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(ab["A"], dtype=np.float32))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(ab["B"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".tmp").replace(out)
    return out
