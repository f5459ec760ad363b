"""The training step shared by every trainer here: micro-batches, the weighted loss, optimizer and schedule, evaluation,
checkpoints, FSDP2.
"""
