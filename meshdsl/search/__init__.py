"""Automatic layout search: calibrate this machine, predict a plan's step time, rank meshes and layouts.

:mod:`.calibrate` (sweeps, fits, the cache file), :mod:`.predict` (a plan's time and memory),
:mod:`.space` (the candidates), :mod:`.search` (compile, prune, rank).
"""
