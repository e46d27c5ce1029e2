"""CPU-machine shim for vLLM's Qwen-VL model code on machines WITHOUT a working torchvision.

vLLM's Qwen2-VL / Qwen2.5-VL / Qwen3-VL model files import `smart_resize` from
`transformers.models.qwen2_vl.image_processing_qwen2_vl`, which imports torchvision at the top; the
CPU machines this project is tested on have no working torchvision (its PyPI builds need CUDA
libraries), so vLLM reports the model "failed to be inspected". This file serves that one module from
the PIL image processor, which defines the same `smart_resize`. Where torchvision imports, it does
nothing. Put this folder on PYTHONPATH *before* vLLM starts, so that every process vLLM (or Ray)
spawns imports it at start-up (GPU machines with vLLM's own wheels have torchvision):

    PYTHONPATH=examples/vlm_shims:$PYTHONPATH python ...
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilTwinLoader(importlib.abc.Loader):   # create_module: the default module object
    def exec_module(self, module):
        twin = importlib.import_module(_PIL_TWIN)
        module.__dict__.update({k: v for k, v in vars(twin).items() if not k.startswith("__")})
        module.__all__ = list(getattr(twin, "__all__", [])) + ["smart_resize"]


class _Finder(importlib.abc.MetaPathFinder):
    """Consulted only for the one module name; decides lazily (at its first import),
    so interpreters that never import it pay nothing."""

    molt_vlm_shim = True  # one finder per process, however many times this file runs

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        try:
            import torchvision  # noqa: F401
            return None
        except Exception:  # installed-but-broken builds raise OSError/RuntimeError at import, not ImportError
            return importlib.machinery.ModuleSpec(fullname, _PilTwinLoader())


if not any(getattr(f, "molt_vlm_shim", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
