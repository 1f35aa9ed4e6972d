"""``lynx sweep``: time-to-first-token against link bandwidth per KV scheme. :mod:`.cli` runs the nodes,
:mod:`.worker` is the decode-side worker process, :mod:`.config` the configuration and schemes, :mod:`.results`
the fixed-column rows and their files, :mod:`.plots` the figures.
"""
