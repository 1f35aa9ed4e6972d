"""``lynx load``: the KV schemes under open-loop Poisson load, like vLLM's serving benchmark. The pure part:
:mod:`.logic` (configuration, rates, arrivals), :mod:`.results` (rows, summaries), :mod:`.report` (``load.json``,
tables). :mod:`.cli` runs a load, :mod:`.launch` starts and stops the nodes, :mod:`.phases` sends the warm-up and
the measured phases; :mod:`.sink` and :mod:`.decode` are the two kinds of decode node, :mod:`.plots` draws the
figures.
"""
