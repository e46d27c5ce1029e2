"""LoRA (--lora_rank R > 0): peft adapters on the policy, served live by the engines.

The trainer injects peft's LoRA layers into the --lora_targets of the policy before FSDP2 (`add_adapters`); only
they train, and the optimizer holds only them. B starts at zero, so version 0 is the base model. The reference of
a KL term is the same model with its adapters off (`BaseView`): no second copy. A weight update sends only the
adapter tensors, in peft's names (`adapter_tensors`), through either --weight_sync path, in memory; the engine
worker swaps them into vLLM's LoRA manager under the one adapter id every request carries (`load_into_engine`),
so a request paused by partial rollout resumes on the new adapter. `export` writes the adapter in peft's format
and the merged model. Checkpoints hold the adapter and its optimizer (checkpoint.py).

    python -m pytest -q tests/test_lora.py
"""

from pathlib import Path

import torch

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_ID = 1                       # the engine's one adapter slot, replaced at every update
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM's max_lora_rank choices


def peft_config(cfg: dict) -> dict | None:
    """The adapter's peft LoraConfig fields (also what vLLM's PEFTHelper reads), or None without LoRA."""
    if not cfg.get("lora_rank"):
        return None
    return {"r": cfg["lora_rank"], "lora_alpha": cfg["lora_alpha"] or 2 * cfg["lora_rank"],
            "target_modules": list(cfg["lora_targets"] or DEFAULT_TARGETS), "lora_dropout": 0.0, "bias": "none",
            "exclude_modules": r".*visual.*"}   # a VLM: the adapter is on the language model only


def check_targets(model_cfg, targets: list[str] | None) -> None:
    """ValueError unless each of --lora_targets names a linear layer of the decoder (what both peft and vLLM's LoRA
    wrap; not lm_head, embeddings or a vision tower), checked on a weightless copy of the model before Ray starts."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    with torch.device("meta"):
        vlm = hasattr(model_cfg, "vision_config")
        model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(model_cfg)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and ".layers." in n and "visual" not in n}
    if bad := sorted(set(targets or DEFAULT_TARGETS) - names):
        raise ValueError(f"--lora_targets {' '.join(bad)}: not a linear layer of this model's decoder; "
                         f"choose from {' '.join(sorted(names))}")


def add_adapters(model: torch.nn.Module, config: dict | None) -> torch.nn.Module:
    """peft's LoRA layers in place (the model keeps its class and module paths); only they require grad.
    The model as it is when `config` is None (no --lora_rank)."""
    if config is None:
        return model
    import warnings

    from peft import LoraConfig, inject_adapter_in_model
    with warnings.catch_warnings():   # a text model has no vision tower to exclude: peft would say so
        warnings.filterwarnings("ignore", "You have passed exclude_modules")
        inject_adapter_in_model(LoraConfig(**config), model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


class BaseView(torch.nn.Module):
    """The policy with its adapters off: the reference model of a LoRA run, sharing the base weights."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = [policy]   # in a list: not a submodule (no parameters of its own)

    @property
    def model(self) -> torch.nn.Module:   # the policy's decoder: parallel.routing finds its (untouched) routers
        return self.policy[0].model

    def forward(self, **inputs):
        from peft.tuners.tuners_utils import BaseTunerLayer
        layers = [m for m in self.policy[0].modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            return self.policy[0](**inputs)
        finally:
            for m in layers:
                m.enable_adapters(True)   # also makes the adapters require grad again, as before


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full adapter tensors on CPU in peft's file names (base_model.model.<module>.lora_A.weight).
    Every rank must call it (each sharded tensor is gathered)."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            out["base_model.model." + name.replace(".default.", ".")] = full.detach().cpu().contiguous()
    return out


def load_into_engine(worker, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    """A vLLM worker's side: replace the adapter in slot ADAPTER_ID with these tensors (no file)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        use_grouped_cpu_ops()
    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(manager.lora_config)
    adapter = LoRAModel.from_lora_tensors(ADAPTER_ID, {k: v.clone() for k, v in tensors.items()}, helper,
                                          device="cpu", dtype=manager.lora_config.lora_dtype,
                                          model_vocab_size=manager.vocab_size)
    slots = manager._adapter_manager   # vLLM's LoRAModelManager: the public add_adapter would read a path
    slots.remove_adapter(ADAPTER_ID)
    slots.add_adapter(adapter)
    slots.activate_adapter(ADAPTER_ID)
    return []


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """x [n, in] times the transposed adapter weights[indices[j]] of each row j: one matmul per adapter in use.
    vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops) copy the adapter's weights for every token instead: with
    them a rank-16 SmolLM2 adapter made generation 6.5x slower than the base model (docs/lora.md)."""
    w, x = (weights.squeeze(1) if weights.dim() == 4 else weights), x.to(dtype)
    out = x.new_empty(x.shape[0], w.shape[1])
    for i in indices.unique().tolist():   # python indexing, as vLLM's ops: -1 is the last slot
        rows = indices == i
        out[rows] = x[rows] @ w[i].to(dtype).T
    return out


def _shrink(x, weights, out, indices, scaling=1.0):
    y = grouped_matmul(x, weights, indices, out.dtype)
    out[:, :y.shape[1]] = scaling * y


def _expand_slice(x, weights, out, indices, offset, size, add_inputs=True):
    y = grouped_matmul(x, weights, indices, out.dtype)[:out.shape[0], :size]   # one row broadcasts, as vLLM's
    if add_inputs:
        out[:, offset:offset + y.shape[1]] += y
    else:
        out[:, offset:offset + y.shape[1]] = y


def use_grouped_cpu_ops() -> None:
    """Swap vLLM's per-token CPU LoRA ops (bgmv_*; its sgmv_* call them) for the grouped ones, same results."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink, module.bgmv_expand_slice = _shrink, _expand_slice
        module.bgmv_expand = lambda x, w, out, i, add_inputs=True: _expand_slice(x, w, out, i, 0, out.shape[1], add_inputs)


def export(base: torch.nn.Module, tensors: dict[str, torch.Tensor], config: dict, path: str) -> torch.nn.Module:
    """Write the adapter in peft's format to PATH/adapter; return `base` with the adapter merged in."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    model = get_peft_model(base, LoraConfig(**config))
    missing = set_peft_model_state_dict(model, tensors).unexpected_keys
    if missing:
        raise RuntimeError(f"LoRA export: {len(missing)} adapter tensors did not load, e.g. {missing[:3]}")
    model.save_pretrained(str(Path(path) / "adapter"))
    return model.merge_and_unload()
