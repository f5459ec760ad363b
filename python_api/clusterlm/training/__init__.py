"""The reference trainer: `clusterlm.train(config)` in this process or on `nproc` ranks, one rank's loop, its checks,
metrics and reporting, and `clusterlm demo`.
"""
