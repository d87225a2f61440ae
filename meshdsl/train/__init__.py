"""Training: the model protocol, steps, optimizers, data, checkpoints and the training loop (:func:`meshdsl.fit`)."""
