"""Write `assets/esm2_tiny/`: a tiny ESM-2-shaped checkpoint in transformers' own format, random weights.

It is the embedded default of the demo and the tests (no network needed). Seeded, so it is reproducible:

    python assets/make_tiny_checkpoint.py
"""

import sys
from pathlib import Path

import torch
from transformers import EsmConfig, EsmForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from convert_checkpoint import ESM_VOCAB, write_esm_tokenizer  # noqa: E402

TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
SEED = 20261122


def esm2_config(**fields: object) -> EsmConfig:
    """An ESM-2 config as `facebook/esm2_*` ship them; `fields` set the shape and override any default."""
    defaults = dict(
        vocab_size=len(ESM_VOCAB),
        mask_token_id=ESM_VOCAB.index("<mask>"),
        pad_token_id=ESM_VOCAB.index("<pad>"),
        max_position_embeddings=1026,
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        architectures=["EsmForMaskedLM"],
    )
    return EsmConfig(**{**defaults, **fields})


def main() -> None:
    folder = Path(__file__).resolve().parent / "esm2_tiny"
    torch.manual_seed(SEED)
    model = EsmForMaskedLM(esm2_config(**TINY_SHAPE)).eval()
    with torch.no_grad():  # every tensor random (LayerNorms and biases too), so no mapping error hides behind zeros
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3 if parameter.dim() == 1 else 0.1)
        model.esm.embeddings.word_embeddings.weight[model.config.pad_token_id].zero_()
    model.save_pretrained(folder)
    write_esm_tokenizer(folder)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
