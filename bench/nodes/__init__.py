"""The two node commands and what they show: ``lynx serve`` (a prefill node, :mod:`.serve`), ``lynx generate``
(a decode node, :mod:`.generate`), the token stream ``--stream`` prints (:mod:`.token_stream`) and the per-request
timeline figure (:mod:`.timeline`).
"""
