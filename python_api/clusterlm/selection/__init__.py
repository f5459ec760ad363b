"""Choosing the examples: the CluSTER method (features -> capacity K-means -> picks -> plan), the `clusterlm select`
pipeline, the paper preset and the baselines.
"""
