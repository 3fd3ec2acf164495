"""Write `assets/esm2_tiny/`: a tiny ESM-2-shaped checkpoint in transformers' own format, random weights.

It is the embedded default of the demo and the tests (no network needed). Seeded, so it is reproducible:

    python assets/make_tiny_checkpoint.py
"""

from pathlib import Path

import torch
from transformers import EsmForMaskedLM

from nv_esm.hub_folder import write_esm_tokenizer
from nv_esm.shapes import TINY_SHAPE, esm2_config

SEED = 20261122


def main() -> None:
    folder = Path(__file__).resolve().parent / "esm2_tiny"
    torch.manual_seed(SEED)
    model = EsmForMaskedLM(esm2_config(**TINY_SHAPE)).eval()
    with torch.no_grad():  # every tensor random (LayerNorms and biases too), so no mapping error hides behind zeros
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3 if parameter.dim() == 1 else 0.1)
        model.esm.embeddings.word_embeddings.weight[model.config.pad_token_id].zero_()
    model.save_pretrained(folder)
    write_esm_tokenizer(folder, remote_code=False)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
