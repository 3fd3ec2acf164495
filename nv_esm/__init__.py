"""nv-esm's installed parts: what the converter, the trainer, the benchmarks and the tests share.

The model itself is the Hub remote code at the top of the repository (`configuration_nv_esm.py`,
`modeling_nv_esm.py` and its flat `modeling_nv_esm_*.py` siblings), which imports nothing from here. Modules:

- `alphabet`: the ESM-2 vocabulary, residue ids, FASTA reading, an example protein.
- `shapes`: the published ESM-2 shapes, a transformers config of any of them, model FLOPs and GPU peaks.
- `state_dict_mapping`: the tensor table between transformers / fair-esm and NVEsm, state-dict and config mapping.
- `checkpoint_io`: safetensors reading and writing, sharding, sizes.
- `hub_folder`: a Hub-ready model folder (config + `auto_map`, tokenizer, remote code, LICENSE), written
  atomically, and pushing it.
- `model_card`: the README.md of converted and of trained models.
- `verification`: does a converted model give the source model's logits on real proteins?
- `conversion_plan`, `conversion`: the converter (`convert_checkpoint.py` is its command line): a checkpoint to
  convert and its plan, rule by rule; converting it, and checking an existing conversion (`verify`).
- `data`: the training data pipeline (read, tokenize, crop, mask, pack).
- `trace_summary`: where a profiled step's time went (`python -m nv_esm.trace_summary`).
- `embed`: the `nv-esm embed` command; its parts `embed_plan` (the first pass over the FASTA file, the settings),
  `embed_model` (the model over the proteins of a shard) and `embed_output` (shards, index, manifest, lock).
- `scoring`: variant-effect scores (masked marginals, wild-type marginals, PLL ratios) and pseudo-log-likelihoods,
  masked copies packed into THD batches; `score`: the `nv-esm score` command around it.
- `train`: the FSDP2 training recipe, split by concern.
- `cli`: the `nv-esm` command.
- `path_guard`: where a command may write and read (outputs never meet inputs, names from data stay in their folder,
  no writing through links); `checkpoint_checks`: a checkpoint's config, tokenizer files and tensors agree, and its
  weights are finite; `proteingym_output`: what `nv-esm proteingym` wrote and from which inputs; `vocabulary`: the
  commands' shared option and method names (torch-free, for the parsers in `cli`).
"""
