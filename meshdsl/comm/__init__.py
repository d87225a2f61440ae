"""Moving bytes: the communicator interface (:mod:`.communicator`) and its transports.

:mod:`.simulated` holds every rank in one process; :mod:`.distributed` runs on
torch.distributed, with same-host shared memory (:mod:`.shm`, :mod:`.shm_pipe`) chosen
inside it; :mod:`.microbatch` folds a pipeline's micro-batch axis into local sums;
:mod:`.bucket` packs many tensors into one collective.
"""
