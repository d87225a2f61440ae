"""Training: the model protocol, steps, optimizers, data, checkpoints and the training loop.

The package itself is callable: ``md.train(model, ...)`` runs
:func:`meshdsl.train.trainer.train`, while ``meshdsl.train.data`` and the other
submodules stay importable under the same name.
"""
import sys
import types


class _CallablePackage(types.ModuleType):
    """The ``meshdsl.train`` package, callable as :func:`meshdsl.train.trainer.train`."""

    def __call__(self, *args, **kwargs):
        from .trainer import train
        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
