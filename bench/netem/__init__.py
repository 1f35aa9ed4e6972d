"""Link emulation (``lynx link``): network namespaces joined by veth pairs and a bridge, shaped with tc.
:mod:`.config` and :mod:`.status` are pure; :mod:`.host` is the one module that runs ``ip`` and ``tc`` (root
only), and :mod:`.link` and :mod:`.bulk` drive it; :mod:`.cli` is the command.
"""
