"""Processes: starting ranks (:mod:`.launcher`, :mod:`.start`), reporting their failures
(:mod:`.failures`) and tuning the allocator (:mod:`.malloc`).

The package imports nothing, so :mod:`.start` (how ranks start) stays free of torch.
"""
