"""Which step of `init_empty_weights` breaks FSDP2's all-gather of block-scaled FP8 weights (one NCCL rank)?

Variants (argv[1]): "as_is"; "te_values" (the FP8 weights keep the values TE's reset_parameters drew: our copy of
the initialisation rule's values skipped); "grad" (TE's reset_parameters with gradients on: rows and columns);
"te_values_grad" (both). Prints one JSON line: the variant, whether a training step ran, the error."""

# ruff: noqa: I001  (Transformer Engine is imported before torch loads cuDNN)
import json
import sys
import tempfile
import traceback

import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import modeling_nv_esm
from configuration_nv_esm import NVEsmConfig
from modeling_nv_esm import NVEsmForMaskedLM
from modeling_nv_esm_layers import is_fp8_tensor

variant = sys.argv[1]
recipe = sys.argv[2] if len(sys.argv) > 2 else "block"
if "te_values" in variant:
    assign = modeling_nv_esm.assign_value

    def keep_fp8(parameter, value):
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if not is_fp8_tensor(local):
            assign(parameter, value)

    modeling_nv_esm.assign_value = keep_fp8
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
result = {"variant": variant, "recipe": recipe}
try:
    config = NVEsmConfig(
        hidden_size=320,
        num_hidden_layers=6,
        num_attention_heads=20,
        intermediate_size=1280,
        backend="te",
        layer_precision=["fp8"] * 6,
        use_quantized_model_init=True,
        fp8_recipe=recipe,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = NVEsmForMaskedLM(config)
    torch.set_default_dtype(torch.float32)
    for layer in model.esm.encoder.layers:
        fully_shard(layer)
    fully_shard(model)
    if "grad" in variant:
        for module in model.modules():
            if getattr(module, "primary_weights_in_fp8", False) and hasattr(module, "reset_parameters"):
                reset = module.reset_parameters

                def with_grad(*args, reset=reset, **kwargs):
                    with torch.enable_grad():
                        return reset(*args, **kwargs)

                module.reset_parameters = with_grad
    model.init_empty_weights()
    weight = model.esm.encoder.layers[0].self_attention.proj.weight.to_local()
    result["weight"] = type(weight).__name__
    result["usages"] = str(weight.get_usages()) if hasattr(weight, "get_usages") else None
    ids = torch.randint(4, 24, (4, 64), device="cuda")
    losses = []
    for _ in range(2):
        loss = model.train()(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    result.update(ok=True, losses=losses)
except Exception as error:  # noqa: BLE001
    result.update(ok=False, error=f"{type(error).__name__}: {error}"[:300], where=traceback.format_exc()[-1200:])
finally:
    dist.destroy_process_group()
print(json.dumps(result), flush=True)
