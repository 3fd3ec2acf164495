"""Write `assets/esm2_tiny/`: a tiny ESM-2-shaped checkpoint in transformers' own format, random weights.

It is the embedded default of the demo and the tests (no network needed). Seeded, so it is reproducible:

    python assets/make_tiny_checkpoint.py
"""

from pathlib import Path

import torch
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer

# The ESM-2 alphabet, in token-id order (33 tokens).
ESM_VOCAB = "<cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O . - <null_1> <mask>".split()
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


def write_tokenizer(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    EsmTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)


def main() -> None:
    folder = Path(__file__).resolve().parent / "esm2_tiny"
    torch.manual_seed(SEED)
    model = EsmForMaskedLM(esm2_config(**TINY_SHAPE)).eval()
    with torch.no_grad():  # every tensor random (LayerNorms and biases too), so no mapping error hides behind zeros
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3 if parameter.dim() == 1 else 0.1)
        model.esm.embeddings.word_embeddings.weight[model.config.pad_token_id].zero_()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
