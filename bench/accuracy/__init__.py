"""Accuracy of the KV schemes: ``lynx accuracy`` (:mod:`.cli`, the report in :mod:`.report`, its workloads
in :mod:`.config`, :mod:`.retrieval`, :mod:`.texts`, scored by :mod:`.scores` through the codec round trip of
:mod:`.schemes` and :mod:`.eval`) and the pass-key workload (:mod:`.workload`) with ``lynx passkey``
(:mod:`.passkey`), the full-precision baseline.
"""
