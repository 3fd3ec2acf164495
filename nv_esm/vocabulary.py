"""The names the commands share: option values, defaults, method names. Free of torch, so that a command's `--help`
answers at once (`nv_esm.cli` builds the parsers from it) and the modules that act on a name take it from here.

The model's own choices (`BACKENDS`, `FP8_LAYER_CHOICES`, `FP8_RECIPES`) are declared by its remote code
(`configuration_nv_esm`, which imports transformers); they are repeated here for the parsers, and
tests/test_option_vocabulary.py checks that the two agree.
"""

from __future__ import annotations

BACKENDS = ("auto", "te", "torch")  # configuration_nv_esm.BACKENDS
FP8_LAYER_CHOICES = ("off", "all", "inner")  # configuration_nv_esm.FP8_LAYER_CHOICES: --fp8
FP8_RECIPES = ("delayed", "current", "block")  # configuration_nv_esm.FP8_RECIPES: nv-esm train's --fp8-scaling
# The inference commands' --fp8-scaling: never delayed (TE updates its scales only in forwards with gradients, so
# inference would run at the initial scale); block by default (`nv_esm.embed_plan`).
FP8_SCALINGS = ("block", "current")
COMMAND_FP8_RECIPE = "block"
TOKENS_PER_BATCH = 16384  # every command's --tokens-per-batch default
# Old option names: each still works, with a one-line notice on stderr (`nv_esm.options.add_renamed`); help shows
# the new.
RENAMED = {"--token-budget": "--tokens-per-batch", "--fp8-recipe": "--fp8-scaling", "--force": "--overwrite"}

# FASTA records (`nv_esm.records`): what a bad record does, and the stop-mark option's help.
INVALID_POLICIES = ("error", "skip")
STRIP_STOP_HELP = "remove a trailing '*' (a stop codon's mark, as in UniProt files) instead of refusing it"

# `nv-esm convert`: the dtypes a conversion writes (`nv_esm.checkpoint_io.DTYPES`), its largest weights file
# (`options.parse_size`), where the logit check runs and its tolerances (`nv_esm.verification`).
CONVERT_DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Largest |logit difference| allowed, by the dtype of the converted weights; the reference always runs in
# float32. float32: both implementations do the same arithmetic in another order (fused QKV GEMM, other
# kernels): 4e-6 on a random 650M-shaped model (33 layers, H100 and CPU alike). bfloat16 keeps 8 significant bits
# and float16 11: rounding weights and activations moved that model's logits by up to 0.07 (bf16) and 0.009
# (fp16). Trained ESM-2 has larger logits than random weights, so the defaults leave ~10x room; a mapping error
# (swapped q/k, wrong head order, a missing bias) moves logits by far more.
DEFAULT_VERIFY_ATOL = {"float32": 1e-4, "float16": 0.1, "bfloat16": 0.75}
# Transformer Engine's fused GELU is the tanh approximation (|gelu_tanh - gelu_erf| <= 5e-4 per activation):
# float32 logits on the TE backend moved by up to 2.7e-3 on the same model.
TE_FP32_VERIFY_ATOL = 5e-2
VERIFY_DEVICES = ("auto", "cpu", "cuda")

# `nv-esm embed` (`nv_esm.embed_plan`): what it writes, what it does with a protein over --max-length, its dtypes.
OUTPUTS = ("mean", "cls", "per_residue", "contacts")
TOO_LONG_POLICIES = ("error", "skip", "crop", "window")
SAVE_DTYPE_NAMES = ("float32", "float16", "bfloat16")

# The scoring methods: `nv_esm.scoring` (nv-esm score) and `nv_esm.proteingym_scoring` (ProteinGym's names, and
# nv-esm score's joint mask). Either command reads "-" and "_" alike (`nv_esm.cli.method_type`).
SCORE_METHODS = ("masked_marginal", "wildtype_marginal", "pseudo_likelihood")
PROTEINGYM_ONLY_METHODS = ("masked-marginals", "wt-marginals", "pseudo-ppl")
PROTEINGYM_METHODS = (*PROTEINGYM_ONLY_METHODS, "masked_marginal")
WINDOW_RULES = ("proteingym", "nv-esm")  # how a wild type longer than the model's window is cut
