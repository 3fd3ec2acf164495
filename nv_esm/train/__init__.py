"""The FSDP2 training recipe of NVEsm (MLM pretraining and fine-tuning), split by concern.

    torchrun --nproc-per-node 8 -m nv_esm.train --model esm2_650M_nv --data uniref50.fasta --steps 100000 --out run
    python -m nv_esm.train --help

- `config`: the run's typed settings (`TrainConfig` and its sections) and the command line that builds them.
- `parallel`: process group and device mesh (flat or hybrid sharding), FSDP2 and prefetch, activation
  checkpointing and offloading, compile.
- `materialize`: the NVEsm config of a run, the meta-device build, each rank's shard read or drawn fresh.
- `lora`: LoRA adapters with stock PEFT on transformers' ESM projection names.
- `feed`: this rank's micro-batches from `nv_esm.data`, prepared ahead with their data positions.
- `validation`: the validation set (files, or a fraction of the data set aside), one pass over it, its metrics.
- `checkpoint`: DCP checkpoints with data positions, RNG and FP8 scaling state; resume guards.
- `metrics`: metrics.jsonl / TensorBoard logging and torch.profiler traces.
- `export`: a consolidated Hub folder from a checkpoint.
- `loop`: the step, the loop and `main`.
"""
