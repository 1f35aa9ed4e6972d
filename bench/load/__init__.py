"""``lynx load``: the KV schemes under open-loop Poisson load, like vLLM's serving benchmark. :mod:`.logic` is
the pure part (configuration, arrivals, rows, summaries, ``load.json``), :mod:`.cli` runs the nodes, :mod:`.sink`
and :mod:`.decode` are the two kinds of decode node, :mod:`.plots` draws the figures.
"""
