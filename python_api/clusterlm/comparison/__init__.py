"""`clusterlm.compare(config)`: every method through the same trainer, evaluation sets, statistics and verdicts,
compare.json/.md/.png.
"""
