"""Plan: which examples every rank trains on, in which order, with which weights.

A plan is what selection produces and what any trainer consumes. It holds, for a data set of N examples
and a world of K ranks, K equally long index lists (rank ``r`` visits ``rank_indices[r]`` in that order),
a per-example weight (0 for unselected examples), the cluster of every example and its squared distance
to its centroid, the original cluster sizes, the token length of every example, and the fingerprint of
the data set it was made for, so a trainer can refuse a plan made for other data.

Weights. For example ``i`` of cluster ``c``: ``w_i = (n_c / N) * (S / s_c)`` with ``n_c`` the size of
cluster ``c``, ``S`` the number of selected examples and ``s_c`` the number selected from ``c``
(:func:`clusterlm.selection.allocation.selection_weights`). With one cluster per rank this is the method's rank weight
``K n_k / N``; in general the weights have mean 1 over the selection, and ``mean_i(w_i * grad_i)`` over the
selection is an unbiased-by-cluster estimate of the full-data mean gradient ``sum_c (n_c / N) * g_c``. The
plan checks that invariant (:meth:`Plan.validate`) with all the others.

Files: ``Plan.save(dir)`` writes ``plan.json`` and ``plan.npz``, checksummed, and ``Plan.load(dir)`` reads
them back and refuses a hand-edited, truncated or mixed-up pair naming the file and the field; the format
and its checks are :mod:`clusterlm.plan.fileformat`'s.

Modules: :mod:`~clusterlm.plan.core` (the ``Plan``: fields, views, checks against data and model, files),
:mod:`~clusterlm.plan.invariants` (``Plan.validate``) and :mod:`~clusterlm.plan.summary` (``Plan.summary``).
"""

from clusterlm.plan.core import Plan, same_model

__all__ = ["Plan", "same_model"]
