"""The tokenizer of a converted folder: AutoTokenizer(trust_remote_code=True) reads residue letters in
either case and refuses any other character in one line, never mapping a protein to a silent `<unk>`; transformers'
pipelines get the same; without trust_remote_code the folder is refused rather than read by `EsmTokenizer`."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, EsmTokenizer, pipeline

from nv_esm.alphabet import CLS, EOS, ESM_VOCAB, MASK, RESIDUE_TO_ID, UNK

RESIDUES = "".join(RESIDUE_TO_ID)  # the 25 letters and the gaps '.' and '-'


def random_case_protein(rng: random.Random, length: int) -> str:
    """A protein of `length` residues of ESM-2's alphabet, each letter in a random case."""
    return "".join(rng.choice((str.upper, str.lower))(rng.choice(RESIDUES)) for _ in range(length))


def expected_ids(text: str) -> list[int]:
    """ESM-2's ids of `text` (residues of either case and `<mask>` tokens), built from the vocabulary alone."""
    ids = []
    for position, piece in enumerate(text.split("<mask>")):
        ids += ([MASK] if position else []) + [RESIDUE_TO_ID[char.upper()] for char in piece if not char.isspace()]
    return [CLS, *ids, EOS]


@pytest.fixture(scope="module")
def tokenizer(nv_tiny):
    return AutoTokenizer.from_pretrained(nv_tiny, trust_remote_code=True)


def test_either_case_reads_as_esm2s_letters(tokenizer, nv_tiny):
    """Random proteins (1 residue to the model's longest) in random case, with `<mask>`s and spaces inserted at
    random places, single and batched: the ids are ESM-2's, built from the vocabulary, and equal what transformers'
    `EsmTokenizer` gives the upper-cased text. On a197d12 a lower-case protein became one `<unk>`."""
    rng = random.Random(0)
    reference = EsmTokenizer.from_pretrained(nv_tiny)
    lengths = [1, 2, 1022, *(rng.randint(1, 300) for _ in range(20))]
    texts = []
    for length in lengths:
        chars = list(random_case_protein(rng, length))
        for _ in range(rng.randint(0, 3)):
            chars.insert(rng.randint(0, len(chars)), rng.choice(("<mask>", " ")))
        texts.append("".join(chars))
    texts.append("mktayiakqrqisfvkshfsrq")
    for text in texts:
        assert tokenizer(text)["input_ids"] == expected_ids(text), text
        upper = "<mask>".join(piece.upper() for piece in text.split("<mask>"))
        assert reference(upper)["input_ids"] == expected_ids(text)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    for row, text in enumerate(texts):
        ids = expected_ids(text)
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert batch["attention_mask"][row].sum().item() == len(ids)


@pytest.mark.parametrize("seed", range(4))
def test_a_character_outside_the_alphabet_is_refused_with_its_position(tokenizer, seed):
    """One character outside ESM-2's alphabet at a random position of a random protein: a one-line ValueError naming
    the character and its 1-based position, alone and inside a batch."""
    rng = random.Random(seed)
    protein = random_case_protein(rng, rng.randint(1, 80))
    bad = rng.choice("*jJ1#ßı?é")
    position = rng.randint(0, len(protein))
    text = protein[:position] + bad + protein[position:]
    expected = f"{bad!r} at position {position + 1} "
    with pytest.raises(ValueError, match=expected) as error:
        tokenizer(text)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=expected):
        tokenizer(["MKV", text], padding=True)


def test_unknown_residues_unk_is_an_explicit_load_time_choice(nv_tiny, tmp_path):
    """`unknown_residues="unk"` reads each unknown character as one `<unk>` (so the ids line up with the residues);
    it is a load-time option that `save_pretrained` leaves out; any other value is refused."""
    lenient = AutoTokenizer.from_pretrained(nv_tiny, trust_remote_code=True, unknown_residues="unk")
    assert lenient("mK*jv")["input_ids"] == [
        CLS,
        RESIDUE_TO_ID["M"],
        RESIDUE_TO_ID["K"],
        UNK,
        UNK,
        RESIDUE_TO_ID["V"],
        EOS,
    ]
    lenient.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert "unknown_residues" not in saved and saved["auto_map"]["AutoTokenizer"][0].endswith(".NVEsmTokenizer")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    with pytest.raises(ValueError, match="'\\*' at position 3"):
        reloaded("mK*jv")
    with pytest.raises(ValueError, match="unknown_residues must be one of"):
        AutoTokenizer.from_pretrained(nv_tiny, trust_remote_code=True, unknown_residues="skip")


def test_without_trust_remote_code_the_folder_is_refused_not_misread(nv_tiny):
    """A converted folder's tokenizer is remote code: without trust_remote_code AutoTokenizer refuses (transformers'
    message asks for it) instead of loading `EsmTokenizer`, which would read lower case as `<unk>`."""
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(nv_tiny)
    assert (nv_tiny / "vocab.txt").read_text().split() == ESM_VOCAB


def test_pipelines_read_lower_case_proteins(nv_tiny):
    """feature-extraction returns one state per residue plus `<cls>`/`<eos>` for a lower-case protein, the same as
    for the upper-case one and as the model gives the ids built from the vocabulary; fill-mask fills a lower-case
    protein's mask as the upper-case one's. On a197d12 the lower-case protein gave a `(1, 3, hidden)` array."""
    protein = random_case_protein(random.Random(5), 37).lower()
    extract = pipeline(
        "feature-extraction",
        model=str(nv_tiny),
        trust_remote_code=True,
        device="cpu",
        model_kwargs={"backend": "torch"},
    )
    lower, upper = np.array(extract(protein)), np.array(extract(protein.upper()))
    model = AutoModel.from_pretrained(nv_tiny, trust_remote_code=True, backend="torch").eval()
    with torch.no_grad():
        direct = model(torch.tensor([expected_ids(protein)])).last_hidden_state.numpy()
    assert lower.shape == (1, len(protein) + 2, model.config.hidden_size)
    np.testing.assert_array_equal(lower, upper)
    np.testing.assert_allclose(lower, direct, rtol=0, atol=1e-6)  # fp32, CPU
    fill = pipeline(
        "fill-mask", model=str(nv_tiny), trust_remote_code=True, device="cpu", model_kwargs={"backend": "torch"}
    )
    masked = protein[:10] + "<mask>" + protein[11:]
    assert fill(masked) == fill(masked.upper().replace("<MASK>", "<mask>"))


def test_a_changed_tokenizer_file_is_not_model_code_the_commands_would_run(nv_tiny, tmp_path):
    """`remote_code_differences` (whether `--trust-remote-code` runs a folder's own model code) looks at the model's
    files only: the commands read the vocabulary with the installed `NVEsmTokenizer`, never the folder's."""
    import shutil

    from nv_esm.hub_folder import remote_code_differences

    folder = shutil.copytree(nv_tiny, tmp_path / "copy")
    with open(folder / "tokenization_nv_esm.py", "a") as file:
        file.write("\n# changed\n")
    assert remote_code_differences(folder) == []
    with open(folder / "modeling_nv_esm.py", "a") as file:
        file.write("\n# changed\n")
    assert remote_code_differences(folder) == ["modeling_nv_esm.py"]
