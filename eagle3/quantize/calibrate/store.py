"""Where calibrated tensors go: a directory of one safetensors file per decoder layer.

The calibration pass runs before the file-to-file quantizer and produces, per in-scope module,
the export tensors the native engine would otherwise compute (same names, dtypes and shapes).
They are small (the quantized weights of one layer), so each layer's are written as soon as the
layer is done and nothing accumulates in memory. A reader (:meth:`TensorStore.get`) finds a
module's tensors by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

INDEX = "index.json"


class TensorStore:
    """``put`` a layer's modules, ``flush`` them to ``layer-NNNN.safetensors``; ``get`` by module."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        idx = self.root / INDEX
        self.index: dict[str, str] = json.loads(idx.read_text()) if idx.is_file() else {}
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, module: str, tensors: dict[str, torch.Tensor]) -> None:
        self._pending[module] = tensors

    def flush(self, name: str) -> None:
        """Write the pending modules as ``name``.safetensors (written aside, then renamed)."""
        from safetensors.torch import save_file

        if not self._pending:
            return
        flat = {f"{m}.{sfx}": t.contiguous() for m, ts in self._pending.items() for sfx, t in ts.items()}
        tmp = self.root / f".{name}.safetensors.tmp"
        save_file(flat, str(tmp))
        os.replace(tmp, self.root / f"{name}.safetensors")
        for m in self._pending:
            self.index[m] = f"{name}.safetensors"
        self._pending = {}
        tmp_idx = self.root / f".{INDEX}.tmp"
        tmp_idx.write_text(json.dumps(self.index, indent=1, sort_keys=True) + "\n")
        os.replace(tmp_idx, self.root / INDEX)

    def __contains__(self, module: object) -> bool:
        return module in self.index

    def modules(self) -> list[str]:
        return sorted(self.index)

    def get(self, module: str) -> dict[str, torch.Tensor]:
        """The export tensors of ``module``: {parameter suffix: tensor}."""
        from safetensors.torch import load_file

        f = self.index[module]
        if f not in self._open:
            self._open = {f: load_file(str(self.root / f))}  # one file at a time: a layer's worth
        prefix = module + "."
        return {k[len(prefix):]: v for k, v in self._open[f].items() if k.startswith(prefix)
                and "." not in k[len(prefix):]}
