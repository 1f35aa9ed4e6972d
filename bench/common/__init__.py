"""What the bench tools share: the error types (:mod:`.errors`), progress bars (:mod:`.progress`), child
processes (:mod:`.processes`), percentiles (:mod:`.stats`) and the node arguments and model loading of
``lynx serve`` / ``lynx generate`` (:mod:`.node_args`).
"""
