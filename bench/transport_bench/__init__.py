"""``lynx bench-transport``: Lynx's transport against raw ucxx, ``ucx_perftest``, asyncio TCP and the
peer engines. :mod:`.cli` is the command and the rounds, :mod:`.baselines`
the raw ucxx / perftest / TCP baselines, :mod:`.peer_runs` the peer engines' side, and :mod:`.peers` the
engines themselves (NIXL, Mooncake TE).
"""
