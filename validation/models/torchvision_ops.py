"""Import torchvision's model definitions beside a CPU PyTorch whose torchvision has no matching operators.

`pip install --no-deps torchvision==0.28.0` next to the CPU `torch==2.13.0` installs a build whose compiled
operators (`_C.so`) do not load; `import torchvision` then fails in `torchvision._meta_registrations`, whose
`torch.library.register_fake("torchvision::nms")` (and `qnms`) needs those operators' schemas. The models
(convolutions, batch norm, pooling: plain PyTorch) never call them. So, when and only when the compiled
library cannot be loaded, the two schemas are defined here, as torchvision's C++ defines them, with no
kernel: a detection model's call of `torchvision.ops.nms` fails with "no kernel" instead of a wrong result.
Where `_C.so` loads (a matching CUDA build on a GPU machine), nothing is defined and torchvision is untouched.
Chosen over copying the model definitions (thousands of lines to keep in step with torchvision) and over
transformers' vision classes (other architectures than the ones CARMA measured).

It is installed in a folder of its own, `.venv/torchvision` (`make setup`: `pip install --no-deps --target`),
not in the environment's packages: there, transformers finds it and imports it whole (for its image
processors), which failed in every `import transformers` model class (`BertForMaskedLM`), the estimate's
own tests included. This module puts that folder on `sys.path`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

# torchvision/csrc/ops/nms.cpp and qnms: the schemas `_meta_registrations` registers fake kernels for
FOLDER = Path(sys.prefix) / "torchvision"  # where `make setup` installs it, beside the environment's packages
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_defined: list[torch.library.Library] = []  # kept alive: a Library's definitions go with it


def import_models():
    """`torchvision.models`, importable whether or not torchvision's compiled operators load; an error
    naming the install command when torchvision is missing."""
    if str(FOLDER) not in sys.path:
        sys.path.append(str(FOLDER))
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"torchvision is not installed: pip install --no-deps --target {FOLDER} torchvision==0.28.0")
    if not _compiled_ops_load(Path(next(iter(spec.submodule_search_locations)))) and not _defined:
        library = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            library.define(schema)
        _defined.append(library)
    import torchvision.models

    return torchvision.models


def _compiled_ops_load(folder: Path) -> bool:
    try:
        torch.ops.load_library(next(folder.glob("_C*.so")))
        return True
    except (StopIteration, OSError, RuntimeError):
        return False
