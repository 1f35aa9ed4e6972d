"""The peer engines ``lynx bench-transport`` compares against: NIXL (:mod:`.nixl`) and Mooncake Transfer
Engine (:mod:`.mooncake`), each run as two child processes; :mod:`.engines` names them and their install hints,
:mod:`.install` installs them (``--install-peers``).
"""
