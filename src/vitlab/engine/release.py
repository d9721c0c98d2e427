"""Memory a command hands back once its engine is ready.

An ONNX Runtime or OpenVINO engine holds its own copy of the weights, so the torch model it was built from is
dead weight for a server or a long `vitlab predict`: at ViT-B/16 the weights once more (346 MB). With the memory
freed while the engine was built and checked, which glibc kept for vitlab (`runtime.tune_cpu_allocator`), a
`vitlab serve --engine onnxruntime` held 2071 MB resident; 1315 MB now (`python benchmarks/serve_memory.py`,
docs/benchmarks.md "Serving memory"). The eager torch engine runs the model, but reads its large weights from
the copies it packed for oneDNN: there the model's own copies go after the engine's next call (1663 -> 1164 MB for
a ViT-B/16 server after a full batch). Commands that own their model call `release_model` when the engine is
ready; `prepare_engine` returns the freed memory either way.
"""

from __future__ import annotations

import torch.nn as nn

from vitlab.errors import VitlabError


def runs_model(engine) -> bool:
    """Whether `engine` computes with the torch model's own tensors (eager or compiled PyTorch). Engines say so
    with `runs_model`; one that does not say is taken to."""
    return bool(getattr(engine, "runs_model", True))


def release_model(model: nn.Module, engine) -> bool:
    """Free `model`'s weights if `engine` does not run it, and return the memory to the OS. The model keeps its
    structure and config (what a command still reads: sizes, class count), its tensors move to the meta device
    (shapes without memory), and calling it raises one line instead of computing. Only for a model the caller
    owns: a model also used elsewhere must not be released. Returns whether it was released. An eager torch
    engine with packed weights instead keeps only those after its next call (`TorchEngine.keep_packed_only`); the
    model then runs through that engine alone, and this returns False."""
    from vitlab.runtime import return_freed_memory

    if runs_model(engine):
        keep_packed_only = getattr(engine, "keep_packed_only", None)
        if keep_packed_only is not None:  # eager PyTorch with packed weights: the plain copies go after its next call
            keep_packed_only()
        return False
    name = getattr(engine, "name", type(engine).__name__)
    model.to_empty(device="meta")

    def released(*_):
        raise VitlabError(f"this model's weights were released once its {name} engine was built (the engine holds "
                          "its own copy); load the model again to run it in PyTorch")

    model.register_forward_pre_hook(released)
    return_freed_memory()
    return True
