"""Every job's settings: one config class per job on one base, the readers of option text and the budget arithmetic they
check; imports neither torch nor transformers.
"""
