"""The tasks a converted or trained model serves, by the names the commands use."""

# Each task's head (a key of `state_dict_mapping.HEADS`; its class: `nv_esm.train.materialize.MODEL_CLASSES`): MLM
# pretraining, or fine-tuning a head.
TASK_HEADS = {"mlm": "masked_lm", "sequence": "sequence_classification", "token": "token_classification"}
